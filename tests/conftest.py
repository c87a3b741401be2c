import os
import shutil
import subprocess
import sys
from pathlib import Path

# tiny models run fastest on one thread, and CI has two cores; subprocesses (CLI runs, `specplug check`) inherit
# it: two threads each beside a busy pytest worker ran such a run 3x slower, and the worker with it
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network

import torch

torch.set_num_threads(1)

import pytest
from transformers.utils import logging as hf_logging

from clean_tree import changes, snapshot
from tiny import make_llama, make_tokenizer

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()

REPO = Path(__file__).resolve().parent.parent
SMALL_V = 6  # small enough to enumerate the exact distribution of 3 tokens


@pytest.fixture(scope="session", autouse=True)
def machine_cache_dir(tmp_path_factory):
    """Machine probes (specplug.machine) cache their choices under the session's temporary directory, not ~/.cache."""
    os.environ["SPECPLUG_CACHE_DIR"] = str(tmp_path_factory.mktemp("machine-cache"))


@pytest.fixture(scope="session", autouse=True)
def tree_stays_clean():
    """Fail the session if any test wrote into the working tree or the directory the suite runs from."""
    cwd = Path.cwd().resolve()
    watched = {REPO: True} if cwd.is_relative_to(REPO) else {REPO: True, cwd: False}
    before = {root: snapshot(root, recursive) for root, recursive in watched.items()}
    yield
    written = [f"{root}: {change}" for root, recursive in watched.items()
               for change in changes(before[root], snapshot(root, recursive))]
    if written:
        pytest.fail("tests wrote outside their temporary directories:\n" + "\n".join(written), pytrace=False)


@pytest.fixture
def without_a_compiler(monkeypatch):
    """A machine with no C compiler, as specplug finds one: every kernel's library is looked for afresh (and again
    after the test), and no machine choice is remembered."""
    from specplug import (activation_kernel, argmax_kernel, attention_kernel, fused_layers, machine, native,
                          norm_kernel, row_products)

    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    loads = (native.build, activation_kernel.load, argmax_kernel.load, attention_kernel.load, norm_kernel.load,
             row_products.load, fused_layers.load)

    def forget():
        for load in loads:
            load.cache_clear()
        machine.forget()

    forget()
    yield "/nonexistent/cc"
    forget()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """A target and a draft sharing a byte-level BPE tokenizer (text prompts, stop strings)."""
    root = tmp_path_factory.mktemp("tiny")
    tok = make_tokenizer(root / "tokenizer")
    vocab = len(tok)
    target = make_llama(root / "target", vocab, hidden=32, layers=2, seed=0, tokenizer_from=root / "tokenizer")
    draft = make_llama(root / "draft", vocab, hidden=16, layers=1, seed=1, tokenizer_from=root / "tokenizer")
    return {"target": target, "draft": draft, "tokenizer": root / "tokenizer", "root": root}


@pytest.fixture(scope="session")
def small_vocab_dirs(tmp_path_factory):
    """Target and draft over a 6-token vocabulary, no tokenizer, no EOS: for exact enumeration."""
    root = tmp_path_factory.mktemp("small")
    target = make_llama(root / "target", SMALL_V, hidden=32, layers=2, seed=0, init=0.3)
    draft = make_llama(root / "draft", SMALL_V, hidden=16, layers=1, seed=7, init=0.2)
    return {"target": target, "draft": draft}


@pytest.fixture(scope="session")
def tiny_target(tiny_dirs):
    import specplug

    return specplug.Target.from_pretrained(tiny_dirs["target"])


@pytest.fixture(scope="session")
def small_target(small_vocab_dirs):
    import specplug

    return specplug.Target.from_pretrained(small_vocab_dirs["target"])


EXAMPLE = REPO / "examples" / "specplug-bigram"


@pytest.fixture(scope="session")
def example_site(tmp_path_factory):
    """The example plugin pip-installed into its own directory (no network: no deps, no build isolation)."""
    site = tmp_path_factory.mktemp("site")
    source = shutil.copytree(EXAMPLE, tmp_path_factory.mktemp("example") / EXAMPLE.name)  # builds write beside it
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True, timeout=300)
    return site


@pytest.fixture(scope="session")
def example_module():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import specplug_bigram
    finally:
        sys.path.remove(str(EXAMPLE))
    return specplug_bigram
