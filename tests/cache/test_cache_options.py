"""AttnStoreCache and ChatPipeline options: the everyday ones as keywords, truncation's details in TruncationConfig
and the pipeline's scheduling knobs in PipelineTuning; the old keywords still work, with a FutureWarning."""

from __future__ import annotations

import inspect
import warnings

import pytest

from hf_attnstore import AttnStore, AttnStoreCache, ChatPipeline, PipelineTuning, TruncationConfig

from ..conftest import char_tokenizer, make_tiny, random_ids


@pytest.fixture(scope="module")
def model():
    return make_tiny("llama")


def test_the_cache_takes_truncation_details_in_truncation_config(model):
    assert "keep_first" not in inspect.signature(AttnStoreCache.__init__).parameters
    with AttnStore(host_bytes="16MiB") as store, warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = AttnStoreCache(model, store, "a", random_ids(40, 0),
                               truncation=TruncationConfig(32, truncation_ratio=0.25, keep_first=2))
        assert (cache.truncation.context_window, cache.truncation.keep_first) == (32, 2)
        assert cache.input_ids.shape[1] < 40 and cache.dropped_tokens > 0  # the window it was given holds
        cache.close()


def test_the_cache_keeps_old_keywords_for_a_release(model):
    with AttnStore(host_bytes="16MiB") as store:
        with pytest.warns(FutureWarning, match=r"`keep_first`, `truncation_ratio` to AttnStoreCache.*"
                          r"TruncationConfig") as caught:
            cache = AttnStoreCache(model, store, "a", random_ids(40, 0), context_window=32, keep_first=2,
                                   truncation_ratio=0.25)
        assert caught[0].filename == __file__
        assert cache.truncation == TruncationConfig(32, 0.25, 2, "decoupled")
        cache.close()
        with pytest.raises(TypeError, match="either a `TruncationConfig`"):
            AttnStoreCache(model, store, "a", random_ids(8, 0), truncation=TruncationConfig(32), context_window=16)
        with pytest.raises(TypeError, match="unexpected keyword argument.*`windw`"):
            AttnStoreCache(model, store, "a", random_ids(8, 0), windw=16)


def test_the_pipeline_takes_scheduling_knobs_in_pipeline_tuning(model):
    histories = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ChatPipeline(model, char_tokenizer(), AttnStore(host_bytes="16MiB"), max_new_tokens=2,
                          tuning=PipelineTuning(prefetch_window=0, histories=histories)) as pipe:
            pipe.chat("a", "hello", timeout=60)
            assert pipe.prefetch_window == 0 and list(histories) == ["a"]


def test_the_pipeline_keeps_old_keywords_for_a_release(model):
    histories = {}
    with pytest.warns(FutureWarning, match=r"`histories`, `prefetch_window` to ChatPipeline.*PipelineTuning"), \
            pytest.warns(FutureWarning, match=r"`keep_first` to ChatPipeline.*TruncationConfig"):
        pipe = ChatPipeline(model, char_tokenizer(), AttnStore(host_bytes="16MiB"), max_new_tokens=2,
                            context_window=64, keep_first=3, prefetch_window=0, histories=histories)
    with pipe:
        pipe.chat("a", "hello", timeout=60)
        assert pipe.prefetch_window == 0 and list(histories) == ["a"] and pipe.truncation.keep_first == 3
        assert "histories" not in pipe.generate_kwargs and "keep_first" not in pipe.generate_kwargs
