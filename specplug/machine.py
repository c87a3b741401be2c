"""Speed choices decided on the machine at hand: short timing probes, cached on disk, overridable.

Which of two equivalent forms of a computation runs faster depends on the CPU and its kernels (on one machine
int8 drafting products beat bf16 ones, float32 products of a few rows ran fastest as ``weight @ xᵀ``; on
another the ranking reversed). Code that has such a choice names its forms and gives a callable for each;
:func:`faster` times them interleaved and keeps the fastest unless the default is within ``margin`` of it.

A decision is cached in memory and in ``$SPECPLUG_CACHE_DIR/machine-choices.json`` (default
``~/.cache/specplug``), keyed by the machine (CPU model and capability, torch version, thread count) and by what
was probed (shapes, dtype, device), so later runs skip the probe and keep the same arithmetic. A probe timed
while other work held the CPUs (its threads waited ``BUSY_SHARE`` of its time or more) decides for this process
only: cached, it would steer every later run by a spell. Precedence: an
explicit option of the caller (e.g. ``weights="int8"``) wins, then ``SPECPLUG_CHOICES="name=form,..."`` (a form
per choice name, for every key), then the cache, then a probe. :func:`machine_choices` lists what this
process decided and why, for reports (``specplug compare``).

Only speed is chosen here: every form of a choice computes the same function, and a choice that changes a
target's rounding is made once per kind of product, before anything is scored, so a one-token step and a
verify pass round alike.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

CACHE_ENV = "SPECPLUG_CACHE_DIR"
OVERRIDE_ENV = "SPECPLUG_CHOICES"
CACHE_FILE = "machine-choices.json"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")  # kernel paths
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "CUDA_VISIBLE_DEVICES")
MIN_BYTES = 1 << 20  # below this much weight a form's speed hardly matters: the default stands, unprobed
# a probe whose threads waited this share of its time for a CPU held by other work is not cached: starved threads
# slow a multi-threaded form far more than a one-threaded one (a 2-thread kernel read 31x slower than numpy)
BUSY_SHARE = 0.1


@dataclass(frozen=True)
class Choice:
    """One decision: ``value`` (a form's name, or a kernel fact) for ``name`` at ``key``; ``source`` is "probe"
    (timed now), "cache" (the cache file), "override" (SPECPLUG_CHOICES), "default" (too small to probe),
    "option" (the caller's explicit option) or "kernel" (a kernel fact measured now: few_rows' identical rows)."""

    name: str
    key: str
    value: str
    why: str
    source: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    def line(self) -> str:
        return f"{self.name} [{self.key}]: {self.value} ({self.source}: {self.why})"


_decided: dict[tuple[str, str, str], Choice] = {}  # (fingerprint, name, key): threads may change mid-process
_disk: dict | None = None


def cache_path() -> Path:
    """The on-disk cache file ($SPECPLUG_CACHE_DIR, default ~/.cache/specplug)."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specplug"
    return Path(root) / CACHE_FILE


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str] | None:
    """/proc/cpuinfo's entries (every CPU lists the same), or None where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)}
    except (OSError, ValueError):
        return None


def cpu_flags() -> set[str] | None:
    """The CPU's instruction-set flags as Linux names them (``amx_tile``, ``avx512_bf16``...), or None if unknown."""
    info = _cpuinfo()
    return None if info is None else set(info.get("flags", "").split())


@functools.lru_cache(maxsize=1)
def hardware() -> str:
    """The CPU's model name, and the GPUs' where torch sees any (their kernels are chosen per model too)."""
    cpu = platform.processor() or platform.machine()
    info, flags = _cpuinfo(), cpu_flags()
    if info is not None:
        cpu = info.get("model name", cpu) + "".join(f" {f}" for f in CPU_FLAGS if f in flags)
    if torch.cuda.is_available():
        gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        cpu += f" | {gpus} (CUDA {torch.version.cuda})"
    return cpu


def fingerprint() -> str:
    """What a cached decision depends on besides what was probed: CPU (and GPUs), torch build and the CPU
    capability it dispatches to, threads, and the settings that steer kernel choice."""
    cpu = hardware()
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "?")()
    # settings that steer which kernels torch and oneDNN pick
    steering = "".join(f" | {v}={os.environ[v]}" for v in KERNEL_ENV if os.environ.get(v))
    return (f"{cpu} | {capability} | torch {torch.__version__} | {torch.get_num_threads()} threads | "
            f"kernels {_kernel_sources()}{steering}")


@functools.lru_cache(maxsize=1)
def _kernel_sources() -> str:
    """A hash of specplug's own C kernels: a changed kernel changes which forms win, so decisions are re-probed."""
    sources = sorted(Path(__file__).with_name("kernels").glob("*.c"))
    return hashlib.sha256(b"".join(f.read_bytes() for f in sources)).hexdigest()[:12]


def overrides() -> dict[str, str]:
    """Forms pinned by SPECPLUG_CHOICES ("name=form,name=form")."""
    text = os.environ.get(OVERRIDE_ENV, "").strip()
    pinned = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, form = item.partition("=")
        if not sep or not name.strip() or not form.strip():
            raise ValueError(f"{OVERRIDE_ENV}={text!r}: expected 'name=form' items separated by commas, got {item!r}")
        pinned[name.strip()] = form.strip()
    return pinned


def _load() -> dict:
    global _disk
    if _disk is None:
        try:
            _disk = json.loads(cache_path().read_text(encoding="utf-8"))
        except (OSError, ValueError):
            _disk = {}
    return _disk


def _store(entry: str, record: dict) -> None:
    """Add one decision to the cache file (re-read first, so concurrent runs lose nothing but a race)."""
    global _disk
    path = cache_path()
    _disk = None
    data = _load()
    data.setdefault(fingerprint(), {})[entry] = record
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the choice still holds for this process


def record(name: str, key: str, value: str, why: str, source: str) -> Choice:
    """Note a decision made elsewhere (an explicit option, a kernel fact) so :func:`machine_choices` lists it."""
    choice = _decided[(fingerprint(), name, key)] = Choice(name, key, value, why, source)
    return choice


def seconds(forms: dict[str, Callable[[], object]], repeats: int = 9,
            statistic: Callable[[list[float]], float] = min) -> dict[str, float]:
    """The fewest seconds each form took over ``repeats`` interleaved runs (or another ``statistic`` of them): on a
    busy machine others' work only ever adds time, and interleaving spreads a long pause over every form alike.
    The order turns each repeat: a call right after another form's can run slower (after oneDNN's bf16 product,
    ~10% at one row), and in a fixed order one form would always pay that."""
    times: dict[str, list[float]] = {name: [] for name in forms}
    names = list(forms)
    with torch.inference_mode():
        for fn in forms.values():
            fn()  # warm up: first calls allocate and pick kernels
        for rep in range(repeats):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                start = time.perf_counter()
                forms[name]()
                times[name].append(time.perf_counter() - start)
    return {name: statistic(t) for name, t in times.items()}


def faster(name: str, key: str, forms: dict[str, Callable[[], object]], default: str, nbytes: int,
           margin: float = 0.1, repeats: int = 9) -> str:
    """The form of ``name`` to use at ``key``: pinned by SPECPLUG_CHOICES, else the ``default`` where the
    weights involved (``nbytes``) are under MIN_BYTES, else cached, else the fastest of ``forms`` by a probe
    (the ``default`` unless another is faster by more than ``margin``, a fraction)."""
    pinned = overrides().get(name)
    if pinned is not None:
        if pinned not in forms:
            raise ValueError(f"{OVERRIDE_ENV}: {name}={pinned!r} is not one of {', '.join(map(repr, forms))}")
        return record(name, key, pinned, f"{OVERRIDE_ENV}", "override").value
    decided = _decided.get((fingerprint(), name, key))
    if decided is not None:
        return decided.value
    if nbytes < MIN_BYTES:
        return record(name, key, default, f"weights of {nbytes} bytes: too small to matter, not probed",
                      "default").value
    entry = f"{name} | {key}"
    cached = _load().get(fingerprint(), {}).get(entry)
    if cached is not None and cached.get("value") in forms:
        return record(name, key, cached["value"], cached.get("why", ""), "cache").value
    waited, started = run_queue_seconds(), time.perf_counter()
    measured = seconds(forms, repeats)
    busy = _waiting_share(waited, started)
    best = min(measured, key=measured.get)
    value = default if measured[default] <= measured[best] * (1 + margin) else best
    why = ", ".join(f"{form} {1e6 * s:.0f} µs" for form, s in measured.items())
    if busy >= BUSY_SHARE:
        why += f"; other work held the CPUs ({busy:.0%} of the probe waiting): decided for this process, not cached"
    else:
        _store(entry, {"value": value, "why": why})
    return record(name, key, value, why, "probe").value


def run_queue_seconds() -> float | None:
    """Seconds this process's threads have spent ready to run but waiting for a CPU (Linux's schedstat), or
    None where the system does not say."""
    total, read = 0, False
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat", encoding="ascii") as f:
                total += int(f.read().split()[1])
            read = True
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total * 1e-9 if read else None


def _waiting_share(waited: float | None, started: float) -> float:
    """The share of the time since ``started`` this process's threads spent waiting for a CPU (0 where unknown);
    a thread that ended meanwhile takes its wait along, so this can only err towards a quiet machine."""
    now = run_queue_seconds()
    elapsed = time.perf_counter() - started
    if waited is None or now is None or elapsed <= 0:
        return 0.0
    return max(0.0, now - waited) / elapsed


def kernel_kept(name: str, key: str, refused: str, forms: dict[str, Callable[[], object]], nbytes: int,
                kernel: str = "kernel", other: str = "torch") -> bool:
    """After a kernel's probe: where it was ``refused`` (why, e.g. it differs from the other form), recorded and
    False (an error where the kernel is pinned); else whether it is the form to use (:func:`faster`)."""
    if refused:
        if overrides().get(name) == kernel:
            raise ValueError(f"{OVERRIDE_ENV}: {name}={kernel} is pinned, but {refused}")
        record(name, key, other, refused, kernel)
        return False
    return faster(name, key, forms, kernel, nbytes) == kernel


def remembered(name: str, key: str, measure: Callable[[], str], why: Callable[[str], str]) -> str:
    """A fact about this machine's kernels (e.g. few_rows' identical rows): from memory, else the cache file,
    else ``measure()`` (then stored); ``why(value)`` says what it means, for :func:`machine_choices`."""
    decided = _decided.get((fingerprint(), name, key))
    if decided is not None:
        return decided.value
    entry = f"{name} | {key}"
    cached = _load().get(fingerprint(), {}).get(entry)
    if cached is not None and isinstance(cached.get("value"), str):
        return record(name, key, cached["value"], why(cached["value"]), "cache").value
    value = measure()
    _store(entry, {"value": value, "why": why(value)})
    return record(name, key, value, why(value), "kernel").value


def machine_choices() -> list[Choice]:
    """Every choice this process has made and every kernel fact it relied on (few_rows' identical rows), in
    order of first use."""
    return list(_decided.values())


def forget() -> None:
    """Drop this process's decisions and its copy of the cache file (tests; after changing SPECPLUG_* settings)."""
    global _disk, generation
    _decided.clear()
    _disk = None
    generation += 1


generation = 0  # how many times decisions were forgotten: a caller keeping a choice at hand re-decides after one
