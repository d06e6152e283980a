"""Fixtures shared by the test modules. Code that tests import lives in helper modules
(`cli_helpers`, `dist_launch`); no test module imports another."""

import os
import shutil
import signal
import sysconfig
import tempfile
from pathlib import Path
from types import MappingProxyType

import pytest
import torch
from hypothesis import settings

# The properties check numbers, not speed: hypothesis's per-example deadline (200 ms) would turn a
# loaded machine into failures.
settings.register_profile("fp8lm", deadline=None)
settings.load_profile("fp8lm")

# Without a GPU, Triton's interpreter runs fp8lm's Triton kernels on CPU tensors. It must be on
# before any @triton.jit decorator runs, and a worker may import those modules for another test
# first: on for the whole session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


FORK_DIR_KEY = pytest.StashKey[str]()


def pytest_configure(config):
    """Under pytest-xdist (``-n``, on by default) each worker takes its share of the cores: torch's
    default, all of them in every worker, would oversubscribe the machine."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    # Multi-rank launches (tests/rank_launcher.py) go through fork servers that import torch and
    # fp8lm once per session, not once per launch; FP8LM_TEST_FORK_SERVER=0 turns them off.
    if os.environ.get("FP8LM_TEST_FORK_DIR") is None and os.environ.get("FP8LM_TEST_FORK_SERVER", "1") != "0":
        fork_dir = tempfile.mkdtemp(prefix="fp8lm-fork-")
        os.environ["FP8LM_TEST_FORK_DIR"] = fork_dir
        config.stash[FORK_DIR_KEY] = fork_dir


def pytest_unconfigure(config):
    """The fork servers this process's session started end with it."""
    fork_dir = config.stash.get(FORK_DIR_KEY, None)
    if fork_dir is None:
        return
    for name in os.listdir(fork_dir):
        if name.endswith(".pid"):
            try:
                os.kill(int(open(os.path.join(fork_dir, name)).read()), signal.SIGTERM)
            except (OSError, ValueError):
                pass  # already gone
    shutil.rmtree(fork_dir, ignore_errors=True)
    os.environ.pop("FP8LM_TEST_FORK_DIR", None)


@pytest.fixture(scope="session")
def email_corpus() -> str:
    """Real text, small enough to scan in milliseconds: the standard library's email package."""
    return str(Path(sysconfig.get_paths()["stdlib"]) / "email")


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> str:
    """One token cache for the session, so each corpus is packed once."""
    return str(tmp_path_factory.mktemp("tokens"))


@pytest.fixture(scope="session")
def tiny_run(email_corpus):
    """`TrainConfig` fields of a tiny, quick run on real text (read-only: copy it into a config)."""
    return MappingProxyType(
        dict(
            model="tiny",
            batch_size=4,
            seq_len=32,
            eval_every=4,
            eval_batches=2,
            progress=False,
            lr=1e-2,
            data=email_corpus,
        )
    )


@pytest.fixture(scope="session")
def tiny_cli_args() -> tuple[str, ...]:
    """`fp8lm train` / `compare` options of a tiny model on short sequences, without a progress bar."""
    return ("--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2", "--no-progress")
