"""Runs eval/ scripts for tests/test_eval_scripts.py, each in a child process forked from this one.

    python tests/eval_runner.py OUT_DIR JOBS_JSON

JOBS_JSON is a list of ``[name, script, args, timeout_s]``. This process imports torch, transformers and
hf_attnstore once, and loads the bundled SmolLM2 once (seconds each on the CI machine); then it forks one child per
job, which runs the script as ``python eval/<script> <args>`` would (``runpy``, ``__main__``), alone and in its own
process group: its module state, monkeypatches, threads, model and exit status are its own (the model's memory is
copy-on-write), and a child past its timeout is killed with any server it started. In a child,
``load_default_model()`` of the default model in float32 on the CPU returns the loaded one. Its stdout and stderr
go to ``OUT_DIR/<name>.log``; ``OUT_DIR/results.json`` maps each name to ``{"code": exit status, "seconds": wall
time, "left": [...]}`` (code -9: killed at its timeout). `left` names what the job left in the temporary folder
(``TMPDIR``: give the runner one of its own), which is then removed so that the next job starts from an empty one.

A child of a process whose OpenMP threads have started (GNU OpenMP) hangs in its first parallel region, and one
whose parent initialized CUDA cannot use it, so everything here runs with one torch thread on the CPU
(``OMP_NUM_THREADS=1``, ``CUDA_VISIBLE_DEVICES=""``, set before torch is imported, inherited by the children and
the servers they start). One thread is also what keeps tiny runs quick on a shared 2-core machine, where two
OpenMP threads per process stall each other.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # before torch: see the module's docstring

import torch  # noqa: E402
import tqdm  # noqa: E402
import transformers  # noqa: F401,E402  (imported once here, for every child)

import hf_attnstore  # noqa: E402
import hf_attnstore.cache.upstream  # noqa: F401,E402
import hf_attnstore.lab.models  # noqa: E402
import hf_attnstore.serving  # noqa: F401,E402
from hf_attnstore.lab.evaluation import corpora  # noqa: F401,E402

ROOT = Path(__file__).resolve().parents[1]


def preload():
    """The default model and tokenizer, loaded once, and a `load_default_model` that returns them (else loads)."""
    load = hf_attnstore.lab.models.load_default_model
    tqdm.tqdm.monitor_interval = 0  # no progress-bar monitor thread: a process that forks had better hold none
    loaded = load()

    def load_default_model(model=None, dtype="float32", device=None, gguf_file=None):
        if loaded and (model, gguf_file) == (None, None) and dtype in ("float32", torch.float32) \
                and device in (None, "cpu"):
            return loaded
        return load(model, dtype=dtype, device=device, gguf_file=gguf_file)

    return load_default_model


def child(script: Path, args: list[str], log: Path, load_default_model) -> None:
    """Runs `script` as ``__main__`` with `args` and leaves the process with its exit status (never returns)."""
    code = 1
    try:
        hf_attnstore.load_default_model = hf_attnstore.lab.models.load_default_model = load_default_model
        os.setpgid(0, 0)  # its own process group: a timeout kills the servers it started too
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(ROOT)
        sys.argv = [str(script), *args]
        sys.path[0] = str(script.parent)  # as `python eval/<script>` sets it
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as e:  # what the interpreter does with it
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then the exit status
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # temporary folders' finalizers, as at a normal exit
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def run(name: str, script: Path, args: list[str], timeout_s: float, out: Path, load_default_model) -> dict:
    sys.stdout.flush()
    sys.stderr.flush()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        child(script, args, out / f"{name}.log", load_default_model)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() - started > timeout_s:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            code = -9
            break
        time.sleep(0.2)
    seconds = round(time.monotonic() - started, 1)
    tmp = Path(tempfile.gettempdir())
    left = sorted(path.name for path in tmp.iterdir())
    for path in tmp.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return {"code": code, "seconds": seconds, "left": left}


def main(argv: list[str]) -> int:
    out, jobs = Path(argv[0]), json.loads(argv[1])
    load_default_model = preload()
    results = {}
    for name, script, args, timeout_s in jobs:
        results[name] = run(name, ROOT / "eval" / script, args, timeout_s, out, load_default_model)
        print(f"{name}: exit {results[name]['code']} in {results[name]['seconds']} s", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
