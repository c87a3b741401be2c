"""The ``specplug`` command line: generate, list proposers (and, from plugins of the project, more)."""
from __future__ import annotations

import json
import sys

import click

from specplug.detokenize import IncrementalDetokenizer
from specplug.plugins import UnknownProposerError, check_proposer_options, failures, get_proposer, list_proposers


matmul_dtype_option = click.option(
    "--matmul-dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
    help="Keep linear weights in and multiply in this dtype; all else stays --dtype. auto: bfloat16 for a "
         "bundled (bf16-trained) target on a CPU with native bf16 products, else --dtype.")


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _parse_options(pairs: tuple[str, ...]) -> dict:
    """``-o key=value`` pairs; values are read as JSON when they parse (numbers, true/false), else strings."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--option")
        try:
            options[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            options[key.replace("-", "_")] = value
    return options


@click.group()
@click.version_option(package_name="specplug")
def main() -> None:
    """Exact speculative decoding with pluggable draft proposers."""


@main.command()
@click.argument("prompt", required=False)
@click.option("--target", "-t", default="zoo:pycode", show_default=True,
              help="Target model: a directory, a hub id, or a bundled zoo: name.")
@click.option("--proposer", "-p", default="draft-model", show_default=True,
              help="Registered proposer name, or 'none' for target-only decoding.")
@click.option("--option", "-o", "options", multiple=True, metavar="KEY=VALUE",
              help="Proposer option, e.g. -o model=path/to/draft or -o prompt_lookup_max=4.")
@click.option("--max-new-tokens", "-n", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--gamma", "-k", "num_speculative_tokens", default=4, show_default=True, type=click.IntRange(min=0),
              help="Draft tokens per step (num_speculative_tokens).")
@click.option("--policy", default="fixed", show_default=True,
              help="γ policy: fixed, heuristic (γ is the start), cost-model (γ is the cap), or a plugin's.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0), help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="float32", show_default=True)
@matmul_dtype_option
@click.option("--strict", is_flag=True, help="A failing proposer is an error instead of a counted fallback.")
@click.option("--json", "as_json", is_flag=True, help="Print tokens, text and stats as JSON.")
def generate(prompt, target, proposer, options, max_new_tokens, num_speculative_tokens, policy, temperature, top_k,
             top_p, seed, stop, device, dtype, matmul_dtype, strict, as_json) -> None:
    """Generate a continuation of PROMPT (read from stdin when omitted or '-')."""
    import specplug

    _quiet_transformers()
    if prompt in (None, "-"):
        prompt = sys.stdin.read()
    proposer_options = _parse_options(options)
    try:
        if proposer != "none":  # a typo in the name or an option is refused before the target loads
            check_proposer_options(proposer, target=None, **proposer_options)
    except (UnknownProposerError, TypeError) as exc:
        raise click.ClickException(f"--proposer {proposer}: {exc}") from exc
    try:
        tgt = specplug.Target.from_pretrained(target, device=device, dtype=dtype, matmul_dtype=matmul_dtype)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"--target {target}: {exc}") from exc
    prop = None
    if proposer != "none":
        try:
            prop = get_proposer(proposer, target=tgt, **proposer_options)
        except (UnknownProposerError, TypeError, ValueError, OSError) as exc:
            raise click.ClickException(f"--proposer {proposer}: {exc}") from exc
    sampling = specplug.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    try:
        gamma_policy = _policy(policy, num_speculative_tokens)
    except (UnknownProposerError, TypeError, ValueError) as exc:
        raise click.ClickException(f"--policy {policy}: {exc}") from exc
    kwargs = dict(max_new_tokens=max_new_tokens, sampling=sampling, num_speculative_tokens=gamma_policy,
                  stop=stop, strict=strict)
    try:
        if as_json:
            result = specplug.generate(tgt, prop, prompt, **kwargs)
            click.echo(json.dumps({"target": target, "proposer": proposer, "prompt": prompt,
                                   "tokens": result.tokens, "text": result.text,
                                   "sampling": sampling.to_dict(), "stats": result.stats.to_dict()}, indent=2))
            return
        steps = specplug.decode_steps(tgt, prop, prompt, **kwargs)
        click.echo(prompt, nl=False)
        text = IncrementalDetokenizer(tgt.decode)  # the one stream() uses
        while True:
            try:
                click.echo(text.push(next(steps)), nl=False)
            except StopIteration as done:
                result = done.value
                break
        click.echo(text.flush())
    except (ValueError, specplug.SpeculationError) as exc:
        raise click.ClickException(str(exc)) from exc
    s = result.stats
    alpha = f"{s.acceptance_rate:.2f}" if s.acceptance_rate is not None else "-"
    click.echo(f"[{s.new_tokens} tokens, {s.tokens_per_second:.1f} tok/s, {s.target_calls} target calls, "
               f"acceptance {alpha}, {s.mean_acceptance_length:.2f} tokens/call, finish: {s.finish_reason}]",
               err=True)


def _policy(name: str, gamma: int):
    """A γ policy from its registered name; γ is fixed's value, heuristic's start and cost-model's cap."""
    from specplug.plugins import get_policy

    options = {"fixed": {"gamma": gamma}, "heuristic": {"gamma": gamma}, "cost-model": {"max_gamma": gamma}}
    return get_policy(name, **options.get(name, {}))


def _numbers(text: str, kind=float, least: float = 0) -> list:
    """A comma-separated list of ``kind`` values, each >= ``least``."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of {kind.__name__}s") from exc
    if not values:
        raise click.BadParameter(f"{text!r} lists no value")
    if min(values) < least:
        raise click.BadParameter(f"each value must be >= {least}, got {min(values)}")
    return values


def _number_list(kind=float, least: float = 0):
    """A click callback reading a comma-separated option into a list when the command line is parsed, so a
    bad value is refused before any model loads."""
    def parse(ctx, param, text):
        return None if text is None else _numbers(text, kind, least)
    return parse


@main.command()
@click.option("--target", "-t", default="zoo:pycode", show_default=True)
@click.option("--proposer", "-p", "proposer_specs", multiple=True, metavar="NAME[:KEY=VALUE,...]",
              help="Proposer to compare (repeatable). Default: every registered proposer that attaches.")
@click.option("--workload", "-w", "workload_specs", multiple=True, default=("humaneval",), show_default=True,
              help="humaneval, stdlib, repeated, or a JSONL file of {\"prompt\": ...} lines (repeatable).")
@click.option("--prompts", "-n", "n_prompts", default=None, type=click.IntRange(min=1),
              help="Prompts taken from each workload. Default: 4; for the load bench, one per request (as many as "
                   "--requests), since copies of a prompt decode alike and would move in step.")
@click.option("--samples", default=1, show_default=True, type=click.IntRange(min=1),
              help="Samples per prompt (repeated sampling; 'repeated' uses at least 5).")
@click.option("--gammas", default="4", show_default=True, callback=_number_list(int),
              help="Comma-separated γ values, e.g. 1,2,4,6,8.")
@click.option("--temperatures", default="0,1", show_default=True, callback=_number_list(float),
              help="Comma-separated temperatures.")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(min=1),
              help="Times each run is repeated (same work, same seeds): what the intervals and the busy-machine "
                   "check are made of.")
@click.option("--peer", default=None, metavar="NAME",
              help="Also run another engine on the same target and prompts: hf (Hugging Face's own assisted "
                   "generation) or vllm (vLLM's engine with its matching methods and specplug's model-free "
                   "proposers inside it; pip install 'specplug[vllm]').")
@click.option("--batch-sizes", default=None, metavar="1,2,4,8,16", callback=_number_list(int, 1),
              help="Load bench instead: goodput and latency per batch size for no speculation, fixed γ and "
                   "the heuristic and cost-model policies, the latter cold (fresh per run) and warm (kept "
                   "across runs, as a server keeps it) (first temperature only).")
@click.option("--requests", type=click.IntRange(min=1), default=None,
              help="Load bench: requests per run (default: the largest batch size). More requests give a longer, "
                   "steadier run per batch size.")
@click.option("--ceiling", default=None, metavar="2,4,6", callback=_number_list(int, 1),
              help="Load bench, greedy: also run an oracle drafter at these γ (target-only's own output, drafted at "
                   "no cost): the most any proposer could reach at each B.")
@click.option("--html", "html_path", default="report.html", show_default=True, help="HTML report ('' for none).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schema specplug.compare/1).")
@click.option("--wide", is_flag=True, help="Print every column (v, tok/s, predictions, latency, ...).")
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="float32", show_default=True)
@matmul_dtype_option
@click.option("--lean/--no-lean", default=True, show_default=True,
              help="Score on the lean forward where it covers the target; --no-lean: HF's own (padded) forward.")
def compare(target, proposer_specs, workload_specs, n_prompts, samples, gammas, temperatures, max_new_tokens,
            repeats, peer, batch_sizes, requests, ceiling, html_path, as_json, wide, device, dtype, matmul_dtype,
            lean) -> None:
    """Compare proposers side by side against target-only decoding on real workloads."""
    import specplug
    from specplug.bench import compare as bench
    from specplug.bench import report as rep
    from specplug.bench.workloads import load

    _quiet_transformers()
    if ceiling and not batch_sizes:
        raise click.BadParameter("the oracle ceiling is a load bench row: give --batch-sizes too",
                                 param_hint="--ceiling")
    if ceiling and temperatures[0] != 0:
        raise click.BadParameter(f"the oracle drafts target-only's greedy output: the load bench's temperature (the "
                                 f"first of --temperatures) must be 0, got {temperatures[0]:g}", param_hint="--ceiling")
    try:
        peer_spec = bench.get_peer(peer) if peer else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--peer") from exc
    if n_prompts is None:
        # a load run's requests should be distinct: greedy copies of one prompt are one sequence decoded
        # several times, so their acceptance dips together and a batch looks burstier than real traffic
        n_prompts = 4 if not batch_sizes else -(-(requests or max(batch_sizes)) // len(workload_specs))
    try:
        specs = [bench.ProposerSpec.parse(s) for s in proposer_specs] or bench.all_proposer_specs()
        workloads = [load(w, n_prompts, samples) for w in workload_specs]
    except (ValueError, ImportError) as exc:
        raise click.ClickException(str(exc)) from exc
    named = specs if proposer_specs else []  # the default, every registered proposer, holds no typo
    for spec in named:
        # a typo (a name, an option) is refused before the target loads; a proposer that fails to attach to
        # the target is skipped with its reason
        try:
            check_proposer_options(spec.name, target=None, **spec.options)
        except (UnknownProposerError, TypeError) as exc:
            raise click.BadParameter(str(exc), param_hint=f"--proposer {spec.label}") from exc
    try:
        tgt = specplug.Target.from_pretrained(target, device=device, dtype=dtype, matmul_dtype=matmul_dtype,
                                              lean=lean)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"--target {target}: {exc}") from exc
    from rich.console import Console
    from rich.progress import Progress

    err = Console(stderr=True)
    if batch_sizes:
        report = _load_bench(tgt, specs, workloads, batch_sizes, gammas, temperatures[0],
                             max_new_tokens, repeats, as_json, err, requests, peer, ceiling or ())
        if html_path:
            from specplug.bench import load

            load.write_html(report, html_path)
            err.print(f"report written to {html_path}")
        return
    attached, _ = bench.attachable(tgt, specs)
    peer_runs = peer_spec.runs_per_prompt(attached, gammas) if peer_spec else 0
    total = bench.count_runs(attached, workloads, gammas, temperatures, repeats, peer_runs)
    with Progress(console=err, transient=True) as bar:
        task = bar.add_task("comparing", total=total)
        try:
            result = bench.run_compare(tgt, specs, workloads, gammas=gammas, temperatures=temperatures,
                                       max_new_tokens=max_new_tokens, repeats=repeats, peer=peer,
                                       progress=lambda n, note: bar.update(task, advance=n, description=note))
        except ImportError as exc:  # --peer vllm without the extra: the message names it
            raise click.ClickException(f"--peer {peer}: {exc}") from exc
    for s in result["skipped"]:
        err.print(f"[yellow]skipped {s['proposer']}:[/yellow] {s['reason']}")
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        width = None if sys.stdout.isatty() else (rep.WIDE_WIDTH if wide else rep.WIDTH)
        rep.print_report(result, Console(width=width), wide=wide)
    if html_path:
        rep.write_html(result, html_path)
        err.print(f"report written to {html_path}")


def _load_bench(target, specs, workloads, batch_sizes, gammas, temperature, max_new_tokens, repeats, as_json, err,
                requests=None, peer=None, ceiling=()):
    from rich.progress import Progress

    from specplug.bench import load
    from specplug.plugins import get_policy

    attached, _ = load.attachable(target, specs)
    warm = get_policy("cost-model", max_gamma=max(gammas))
    policies = {"heuristic": lambda: get_policy("heuristic", gamma=max(gammas)),
                # cold: a fresh policy per run pays its measurements in every run (~1-2 s of decoding here);
                # warm: one policy kept across runs, as a server keeps it, reuses what it measured (of each
                # proposer apart: it serves them all)
                "cost-model": lambda: get_policy("cost-model", max_gamma=max(gammas)),
                "cost-model warm": lambda: warm}
    prompts = [p for w in workloads for p in w.prompts]
    runner = _load_peer(peer, target, attached, gammas, batch_sizes)
    try:
        with Progress(console=err, transient=True) as bar:
            task = bar.add_task("load", total=load.count_runs(attached, batch_sizes, gammas, policies, repeats,
                                                              ceiling))
            report = load.run_load(target, specs, batch_sizes=batch_sizes, gammas=gammas, policies=policies,
                                   max_new_tokens=max_new_tokens, prompts=prompts, temperature=temperature,
                                   repeats=repeats, requests=requests, peer=runner, ceiling=ceiling,
                                   progress=lambda n, note: bar.update(task, advance=n, description=note))
    finally:
        if runner is not None:
            runner.close()
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        load.render(report)
        if report.get("peer"):
            from specplug.bench.peer_vllm import render_load

            render_load(report["peer"])
    return report


def _load_peer(peer, target, specs, gammas, batch_sizes):
    """The load bench's peer: vLLM's engines sized for the largest batch; HF's generate takes one row only."""
    if peer is None:
        return None
    if peer != "vllm":
        raise click.ClickException(f"--peer {peer} with --batch-sizes: Hugging Face's assisted generation refuses "
                                   "batches; use --peer vllm")
    from specplug.bench.peer_vllm import VLLMPeer

    try:
        return VLLMPeer(target, specs, gammas, max_num_seqs=max(batch_sizes))
    except ImportError as exc:
        raise click.ClickException(f"--peer vllm: {exc}") from exc


@main.command()
@click.argument("name")
@click.option("--option", "-o", "options", multiple=True, metavar="KEY=VALUE", help="Proposer option.")
@click.option("--samples", default=2000, show_default=True, type=click.IntRange(min=100),
              help="Samples per statistical check.")
@click.option("--verification", type=click.Choice(["token", "block"]), default="token", show_default=True,
              help="How the exactness checks verify sampled chains (block: Sun et al.'s block verification).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def check(name, options, samples, verification, as_json) -> None:
    """Check that proposer NAME is honest and exact (the conformance kit); exit 1 on any failure."""
    from specplug.conformance import ConformanceKit, registry_factory

    _quiet_transformers()
    kit = ConformanceKit(samples=samples, verification=verification)
    try:
        results = kit.run(registry_factory(name, _parse_options(options)))
    except (UnknownProposerError, TypeError, ValueError) as exc:
        raise click.ClickException(f"{name}: {exc}") from exc
    if as_json:
        click.echo(json.dumps([{"check": r.name, "status": r.status, "evidence": r.evidence} for r in results],
                              indent=2))
    else:
        for r in results:
            colour = {"pass": "green", "fail": "red", "skip": "yellow"}[r.status]
            click.echo(f"{click.style(r.status.upper(), fg=colour):>6}  {r.name:26s} {r.evidence}")
    failed = [r.name for r in results if not r.passed]
    if failed:
        click.echo(f"proposer {name!r} FAILED: {', '.join(failed)}", err=True)
        sys.exit(1)
    click.echo(f"proposer {name!r} conforms", err=True)


@main.command("proposers")
@click.option("--json", "as_json", is_flag=True, help="Print name, source distribution and description as JSON.")
def proposers_cmd(as_json: bool) -> None:
    """List the registered proposers (built-in and from installed plugins)."""
    found = list_proposers()
    if as_json:
        click.echo(json.dumps({
            "proposers": [{"name": i.name, "source": i.source, "description": i.description} for i in found.values()],
            "failed_plugins": [{"plugin": f.plugin, "source": f.source, "error": f.error} for f in failures],
        }, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "source", "description")
    for info in found.values():
        table.add_row(info.name, info.source, info.description)
    console = Console()
    console.print(table)
    for f in failures:
        console.print(f"[red]plugin {f.plugin!r} from {f.source!r} failed to load:[/red] {f.error}")


@main.command("export")
@click.argument("head")
@click.option("--format", "fmt", type=click.Choice(["speculators"]), default="speculators", show_default=True,
              help="speculators: the EAGLE-3 format vLLM serves (speculative_config={'model': OUT, ...})")
@click.option("--out", type=click.Path(file_okay=False), required=True, help="directory to write")
@click.option("--target", "-t", default=None, help="the head's target (default: the one its config names)")
@click.option("--speculative-tokens", default=3, show_default=True, type=click.IntRange(min=1),
              help="γ the exported config proposes (vLLM's default num_speculative_tokens)")
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]), default="float16", show_default=True)
def export_cmd(head, fmt, out, target, speculative_tokens, dtype) -> None:
    """Write a trained head (a directory or zoo: name, e.g. zoo:pycode-eagle3) in another format."""
    import torch

    from specplug.speculators_format import SpeculatorsMissingError, export_eagle3

    _quiet_transformers()
    tgt = None
    if target:
        from specplug.target import Target

        tgt = Target.from_pretrained(target, matmul_dtype=None)
    try:
        path = export_eagle3(head, out, target=tgt, speculative_tokens=speculative_tokens, dtype=getattr(torch, dtype))
    except (SpeculatorsMissingError, ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"exported {head} -> {path} ({fmt}); serve it with vLLM: speculative_config="
               f"{{'method': 'eagle3', 'model': '{path}', 'num_speculative_tokens': {speculative_tokens}}}")


def _attach_training() -> None:
    """``specplug train tokenizer|target|draft|export|eagle|mtp``: the commands that made the bundled zoo."""
    from specplug.training.cli import train_group
    from specplug.training.heads_cli import add_head_commands

    add_head_commands(train_group)
    main.add_command(train_group)


_attach_training()

if __name__ == "__main__":
    main()
