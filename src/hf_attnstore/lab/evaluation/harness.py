"""An lm-eval model (``--model attnstore``) that scores every request after a context overflow.

The paper's protocol: "input a long text to simulate the overflow ... then append the questions". Each
request is appended to a filler history of ``context_window - 1`` tokens whose KV is already in the
store, so it overflows the window and the history is truncated with the chosen mode before the request
is scored. ``truncation="none"`` keeps the whole filler (no window), the upper bound.

The filler's KV is computed once. Requests are read-only turns (``AttnStoreCache(save=False)``): each
starts from the same stored filler. Single-token continuations of one context (multiple choice) share
one forward, which gives exactly the log-probabilities separate requests would.

lm-eval's CLI only knows its own models, so run it through this module, which registers ``attnstore``
and adds the ``mmlu_offline`` task folder to ``--include_path``::

    python -m hf_attnstore.lab.evaluation.harness --model attnstore \\
        --model_args truncation=decoupled,context_window=1024 --tasks mmlu_offline --limit 500
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from ...cache.cache import AttnStoreCache
from ...cache.config import SparseConfig, TruncationConfig
from ...store import AttnStore, StoreTuning
from ...cache.upstream import cache_kwargs

logger = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).parent / "tasks"
TRUNCATIONS = ("none", "decoupled", "recompute", "naive")
_SEPARATOR = "\n\n"


def filler_text(tokenizer, tokens: int) -> list[int]:
    """`tokens` ids of real text to fill the window: ShareGPT conversations, in file order, as plain text.

    Ends with a blank line that separates it from the request.
    """
    from ..data import iter_sharegpt

    sep = tokenizer(_SEPARATOR, add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    for conv in iter_sharegpt():
        for message in conv.messages:
            ids.extend(tokenizer(message["content"] + _SEPARATOR, add_special_tokens=False)["input_ids"])
        if len(ids) >= tokens:
            return ids[: tokens - len(sep)] + sep
    raise ValueError(f"ShareGPT holds fewer than {tokens} tokens of text for the filler")


@register_model("attnstore")
class AttnStoreLM(TemplateLM):
    """lm-eval model: a Hugging Face causal LM scored through :class:`AttnStoreCache` after an overflow.

    Args:
        pretrained: A model id or folder, ``None``/``"smollm2"`` for the bundled SmolLM2, or a loaded
            ``PreTrainedModel`` (then `tokenizer` is required).
        tokenizer: The tokenizer, when `pretrained` is a model object.
        dtype: Model dtype when loading (``"float32"``, ``"bfloat16"``...).
        device: Where to load the model; defaults to CUDA when available.
        truncation: ``"decoupled"``, ``"recompute"``, ``"naive"`` or ``"none"`` (no window).
        context_window: The window W the filler history fills.
        keep_first: Attention-sink tokens kept at truncation.
        truncation_ratio: Fraction of the window dropped at an overflow.
        filler_tokens: Length of the filler history; default ``context_window - 1``, so every request
            overflows.
        kv_codec: ``"int8"`` or ``"int4"``: the filler is stored in a disk tier with that lossy codec and
            every request reads it back from there (dequantized); default lossless, in host memory.
        kv_budget: Sparse window attention over the filler (`AttnStoreCache(kv_budget=...)`): the fraction of
            the history each request attends to (sinks, recent tokens and, by `sparse_policy`, the most important
            ones by the scores stored with the filler). Default ``None``: dense.
        sparse_policy: ``"alisa"``, ``"h2o"`` or ``"streaming"`` (see :class:`~hf_attnstore.SparseConfig`).
        batch_size: Accepted for lm-eval's CLI; requests run one at a time (one session per cache).
    """

    def __init__(self, pretrained=None, tokenizer=None, dtype: str = "float32", device: str | None = None,
                 truncation: str = "decoupled", context_window: int = 1024, keep_first: int = 4,
                 truncation_ratio: float = 0.5, filler_tokens: int | None = None, kv_codec: str | None = None,
                 kv_budget: float | None = None, sparse_policy: str = "alisa", batch_size=1, max_batch_size=None,
                 **kwargs):
        super().__init__()
        if truncation not in TRUNCATIONS:
            raise ValueError(f"unknown truncation {truncation!r}: expected one of {', '.join(TRUNCATIONS)}")
        if kwargs:
            logger.warning("AttnStoreLM ignores model_args %s", sorted(kwargs))
        if pretrained is None or isinstance(pretrained, str):
            from ..models import load_default_model

            name = None if pretrained in (None, "", "smollm2", "default") else pretrained
            if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
                # lm-eval's CLI passes --device (default "cuda"); like its HF model, fall back to the CPU.
                logger.warning("device %r is not available: using the CPU", device)
                device = "cpu"
            self.model, self.tokenizer = load_default_model(name, dtype=dtype, device=device)
        else:
            if tokenizer is None:
                raise ValueError("pass `tokenizer` along with a model object")
            self.model, self.tokenizer = pretrained, tokenizer
        self.model.eval()
        self.truncation = truncation
        self.context_window = int(context_window)
        self.keep_first = int(keep_first)
        self.truncation_ratio = float(truncation_ratio)
        n_filler = self.context_window - 1 if filler_tokens is None else int(filler_tokens)
        if not 0 < n_filler < self.context_window or self.keep_first >= n_filler:
            raise ValueError(f"`filler_tokens` must be in ({self.keep_first}, {self.context_window}), got {n_filler}")
        self._filler = torch.tensor(filler_text(self.tokenizer, n_filler), dtype=torch.long)
        self._tmp = None
        if kv_codec in (None, "", "none"):
            self._store = AttnStore(host_bytes=2**62)
        else:
            # The filler goes through a cold copy with the codec: written to a disk tier, evicted, and loaded
            # back (dequantized) by the first request; every request then reads the same lossy history.
            self._tmp = tempfile.TemporaryDirectory(prefix="attnstore-lm-eval-")
            self._store = AttnStore(host_bytes=2**62, disk_dir=self._tmp.name, kv_codec=kv_codec,
                                    tuning=StoreTuning(fsync=False))
        # The filler's first turn is dense (nothing before it to select from) and stores its scores for the requests.
        self._sparse = None if kv_budget in (None, "", "none") else SparseConfig(float(kv_budget), policy=sparse_policy)
        self._label = truncation if self._sparse is None else f"{sparse_policy}@{float(kv_budget):g}"
        self._truncated_requests = 0
        with torch.no_grad():
            first = AttnStoreCache(self.model, self._store, "filler", self._filler, kv_budget=self._sparse)
            self.model(first.input_ids, **cache_kwargs(first))
            first.close()
        if self._tmp is not None:
            self._store.flush()
            self._store.evict("filler")

    # -- lm-eval's tokenizer interface ---------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"]

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # -- scoring -------------------------------------------------------------------------------------
    def _cache(self, request_ids: list[int]) -> AttnStoreCache:
        """A read-only cache for the filler followed by `request_ids`, truncated as configured."""
        window = None if self.truncation == "none" else self.context_window
        mode = "decoupled" if self.truncation == "none" else self.truncation
        prompt = torch.cat([self._filler, torch.tensor(request_ids, dtype=torch.long)])
        truncation = TruncationConfig(window, self.truncation_ratio, self.keep_first, mode)
        return AttnStoreCache(self.model, self._store, "filler", prompt, truncation=truncation, save=False,
                              kv_budget=self._sparse)

    def _fit(self, context: list[int], continuation: list[int]) -> list[int]:
        """Cuts the context from the left so that the request fits the window beside the sinks."""
        room = self.context_window - self.keep_first - 1 - len(continuation)
        if room < 1:
            raise ValueError(f"a continuation of {len(continuation)} tokens does not fit a {self.context_window}-token "
                             "window: raise `context_window`")
        if len(context) > room:
            self._truncated_requests += 1
            return context[-room:]
        return context

    @torch.no_grad()
    def _logprobs(self, context: list[int], continuation: list[int]) -> torch.Tensor:
        """Log-probabilities ``[len(continuation), vocab]`` predicting each continuation token."""
        cache = self._cache(context + continuation)
        rest = cache.input_ids[:, cache.reused_tokens :]
        assert rest.shape[1] > len(continuation), "the request is always computed"
        logits = self.model(rest, **cache_kwargs(cache)).logits[0, -len(continuation) - 1 : -1]
        return F.log_softmax(logits.float(), dim=-1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        # Single-token continuations of one context share a forward: the last context position's
        # distribution scores them all, and the truncation (which depends on the total length) is the same.
        groups: dict[tuple, list[int]] = {}
        for i, (_, context, continuation) in enumerate(requests):
            key = (tuple(context),) if len(continuation) == 1 else (tuple(context), tuple(continuation))
            groups.setdefault(key, []).append(i)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for indices in tqdm(groups.values(), desc=f"attnstore ({self._label})", disable=disable_tqdm):
            _, context, continuation = requests[indices[0]]
            context = self._fit(list(context), list(continuation))
            logprobs = self._logprobs(context, list(continuation))
            for i in indices:
                target = torch.tensor(requests[i][2], device=logprobs.device)
                lp = logprobs[: target.numel()]
                picked = lp.gather(1, target[:, None])[:, 0]
                results[i] = (float(picked.sum()), bool(torch.equal(lp.argmax(-1), target)))
                self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
        if self._truncated_requests:
            logger.warning("%d requests were longer than the window and lost their oldest context tokens",
                           self._truncated_requests)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(
            "AttnStoreLM scores requests after an overflowed filler history; for perplexity of long texts "
            "through a bounded window use `attnstore eval ppl`"
        )

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        outputs = []
        for request in tqdm(requests, desc=f"attnstore ({self._label})", disable=disable_tqdm):
            context, gen_kwargs = request.args
            until = gen_kwargs.get("until") or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", 256))
            cache = self._cache(self._fit(self.tok_encode(context), [0] * max_new))
            out = self.model.generate(cache.input_ids, **cache_kwargs(cache), max_new_tokens=max_new,
                                      do_sample=False, pad_token_id=self.eot_token_id)
            text = self.tok_decode(out[0, cache.input_ids.shape[1] :].tolist())
            for stop in until:
                text = text.split(stop)[0]
            outputs.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return outputs


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with ``attnstore`` registered and the ``mmlu_offline`` task available."""
    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--include_path" not in argv:
        argv += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
