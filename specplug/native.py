"""specplug's C kernels (``kernels/*.c``): compiled for this CPU on first use, cached, loaded by ctypes.

Each source is built with ``cc -O3 -march=native -fopenmp`` into ``$SPECPLUG_CACHE_DIR/kernels`` (default
``~/.cache/specplug``), keyed by the source, the flags, the compiler and the CPU, atomically (concurrent builds
each rename a whole file). Without a compiler, or where a source does not build for this CPU (e.g. AVX-512
BF16 intrinsics on an AVX2 CPU), :func:`build` says why and its callers fall back to torch's forms. A compiler's refusal
is kept beside the would-be library (``.failed``), so later processes do not compile again; a timeout is not
kept, as a busy machine may build the source next time.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from . import machine

KERNELS = Path(__file__).with_name("kernels")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


@functools.lru_cache(maxsize=None)
def build(source: str) -> tuple[ctypes.CDLL | None, str]:
    """The compiled ``kernels/<source>``, or None and why it is not available."""
    path = KERNELS / source
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, f"no C compiler on PATH (cc, gcc or $CC) to build {source}"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        text = path.read_text(encoding="utf-8")
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"cannot run {compiler} or read {source}: {err}"
    key = hashlib.sha256("\n".join([text, " ".join(FLAGS), version, machine.hardware()]).encode()).hexdigest()[:16]
    target = machine.cache_path().parent / "kernels" / f"{path.stem}-{key}.so"
    refused = target.with_suffix(".failed")
    if refused.exists():
        return None, refused.read_text(encoding="utf-8")
    if not target.exists():
        reason, final = _compile(compiler, path, target)
        if reason:
            if final:
                _write_atomically(refused, reason)
            return None, reason
    try:
        return ctypes.CDLL(str(target)), ""
    except OSError as err:
        return None, f"cannot load {target}: {err}"


I64, PTR = ctypes.c_int64, ctypes.c_void_p


def bind(source: str, signatures: dict[str, tuple[list, object]]) -> tuple[ctypes.CDLL | None, str]:
    """:func:`build` ``source`` and declare each named function's (argument types, result type) for ctypes; or
    None and why the library is not available."""
    lib, reason = build(source)
    if lib is None:
        return None, reason
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib, ""


def _compile(compiler: str, source: Path, target: Path) -> tuple[str, bool]:
    """Build ``source`` into ``target``: ("", _) or why not, and whether the compiler itself refused."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            run = subprocess.run([compiler, *FLAGS, str(source), "-o", str(built), "-lm"],
                                 capture_output=True, text=True, timeout=300)
            if run.returncode != 0:
                return f"{compiler} could not build {source.name} for this CPU: {run.stderr.strip()[-300:]}", True
            os.replace(built, target)
    except (OSError, subprocess.SubprocessError) as err:
        return f"cannot build {source.name} with {compiler}: {err}", False
    return "", False


def _write_atomically(path: Path, text: str) -> None:
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, encoding="utf-8") as f:
            f.write(text)
        os.replace(f.name, path)
    except OSError:
        pass  # an unwritable cache only costs the next process a compile
