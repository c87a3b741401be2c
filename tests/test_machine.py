"""Speed choices decided on the machine at hand: the fastest form by a probe (the default unless clearly beaten),
cached on disk per machine, pinned by SPECPLUG_CHOICES, beaten by a caller's explicit option, and listed with
their reasons by machine_choices(). Timings are replaced by fixed numbers: no test asserts how fast anything is."""
import json
from pathlib import Path

import pytest
import torch
from tiny import private_machine_cache  # noqa: F401 (autouse: a private speed-choice cache)

from specplug import few_rows, machine
from specplug.lean_llama import COPY, lean_or_reason
from specplug.proposers.eagle import EagleProposer

BIG = machine.MIN_BYTES  # weights this large are worth a probe


@pytest.fixture
def timings(monkeypatch):
    """Make every probe report the seconds in ``timings.table`` and count the probes."""

    class Fake:
        table: dict[str, float] = {}
        probes = 0

    def seconds(forms, repeats=9):
        Fake.probes += 1
        return {name: Fake.table[name] for name in forms}

    monkeypatch.setattr(machine, "seconds", seconds)
    monkeypatch.setattr(machine, "run_queue_seconds", lambda: 0.0)  # a quiet machine unless a test says otherwise
    return Fake


FORMS = {"plain": lambda: None, "fancy": lambda: None}


def test_the_default_stands_unless_another_form_is_faster_by_the_margin(timings):
    timings.table = {"plain": 1.0, "fancy": 0.95}
    assert machine.faster("demo", "a", FORMS, "plain", BIG) == "plain"
    timings.table = {"plain": 1.0, "fancy": 0.5}
    assert machine.faster("demo", "b", FORMS, "plain", BIG) == "fancy"
    assert machine.faster("demo", "b", FORMS, "plain", BIG) == "fancy" and timings.probes == 2  # decided once


def test_a_decision_is_cached_on_disk_per_machine_and_reused_without_a_probe(timings, monkeypatch):
    timings.table = {"plain": 1.0, "fancy": 0.5}
    assert machine.faster("demo", "k", FORMS, "plain", BIG) == "fancy"
    stored = json.loads(machine.cache_path().read_text())
    assert stored[machine.fingerprint()]["demo | k"]["value"] == "fancy"
    machine.forget()  # a new process
    timings.table = {"plain": 0.5, "fancy": 1.0}
    assert machine.faster("demo", "k", FORMS, "plain", BIG) == "fancy" and timings.probes == 1
    choice, = machine_choices_named("demo")
    assert choice.source == "cache" and "fancy" in choice.why
    machine.forget()
    monkeypatch.setattr(machine, "fingerprint", lambda: "another CPU")  # another machine probes for itself
    assert machine.faster("demo", "k", FORMS, "plain", BIG) == "plain" and timings.probes == 2


def test_a_probe_timed_while_other_work_held_the_cpus_decides_for_this_process_but_is_not_cached(timings,
                                                                                                  monkeypatch):
    timings.table = {"plain": 1.0, "fancy": 0.5}
    waited = iter([0.0, 5.0])  # this process's threads waited 5 s for a CPU during the probe
    monkeypatch.setattr(machine, "run_queue_seconds", lambda: next(waited))
    assert machine.faster("demo", "k", FORMS, "plain", BIG) == "fancy"
    choice, = machine_choices_named("demo")
    assert choice.source == "probe" and "not cached" in choice.why
    assert not machine.cache_path().exists()
    machine.forget()  # a new process, on a quiet machine: probes again, and caches that
    monkeypatch.setattr(machine, "run_queue_seconds", lambda: 0.0)
    assert machine.faster("demo", "k", FORMS, "plain", BIG) == "fancy" and timings.probes == 2
    assert json.loads(machine.cache_path().read_text())[machine.fingerprint()]["demo | k"]["value"] == "fancy"


def test_run_queue_seconds_reads_this_process_waiting_time_where_linux_reports_it():
    waited = machine.run_queue_seconds()
    if not Path("/proc/self/task").is_dir():
        assert waited is None
    else:
        assert isinstance(waited, float) and waited >= 0.0


def test_a_probe_turns_the_order_of_its_forms_so_none_always_runs_right_after_another():
    calls = []
    forms = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    assert set(machine.seconds(forms, repeats=3)) == {"a", "b", "c"}
    timed = calls[3:]  # after one warm-up call each
    assert [timed[i:i + 3] for i in (0, 3, 6)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]


def machine_choices_named(name):
    return [c for c in machine.machine_choices() if c.name == name]


def test_small_weights_keep_the_default_without_a_probe(timings):
    assert machine.faster("demo", "tiny", FORMS, "fancy", BIG - 1) == "fancy" and timings.probes == 0
    choice, = machine_choices_named("demo")
    assert choice.source == "default" and "too small" in choice.why


def test_specplug_choices_pins_a_form_and_bad_settings_are_clear_errors(timings, monkeypatch):
    timings.table = {"plain": 1.0, "fancy": 0.1}
    monkeypatch.setenv(machine.OVERRIDE_ENV, "demo=plain, other=x")
    assert machine.faster("demo", "k", FORMS, "fancy", BIG) == "plain" and timings.probes == 0
    assert machine_choices_named("demo")[0].source == "override"
    monkeypatch.setenv(machine.OVERRIDE_ENV, "demo=turbo")
    with pytest.raises(ValueError, match="SPECPLUG_CHOICES: demo='turbo' is not one of 'plain', 'fancy'"):
        machine.faster("demo", "k", FORMS, "fancy", BIG)
    monkeypatch.setenv(machine.OVERRIDE_ENV, "demo")
    with pytest.raises(ValueError, match="expected 'name=form'"):
        machine.faster("demo", "k", FORMS, "fancy", BIG)


def test_an_unwritable_cache_still_decides(timings, monkeypatch, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(machine.CACHE_ENV, str(tmp_path / "file"))  # a file where the directory should be
    timings.table = {"plain": 1.0, "fancy": 0.5}
    assert machine.faster("demo", "k", FORMS, "plain", BIG) == "fancy"


def test_machine_choices_report_each_choice_and_the_few_rows_kernel_facts(timings):
    timings.table = {"plain": 1.0, "fancy": 0.5}
    machine.faster("demo", "k", FORMS, "plain", BIG)
    few_rows.forget_probes()
    few_rows.identical_rows(torch.empty(40, 24, dtype=torch.bfloat16))
    report = {c.name: c for c in machine.machine_choices()}
    assert report["demo"].as_dict() == {"name": "demo", "key": "k", "value": "fancy", "source": "probe",
                                        "why": "plain 1000000 µs, fancy 500000 µs"}
    assert report["identical_rows"].source == "kernel" and "40x24" in report["identical_rows"].key
    assert report["demo"].line() == "demo [k]: fancy (probe: plain 1000000 µs, fancy 500000 µs)"
    few_rows.forget_probes()


def test_drafting_weights_follow_the_machine_unless_given_explicitly(small_target, monkeypatch):
    monkeypatch.setenv(machine.OVERRIDE_ENV, "int8_drafting=float")
    assert EagleProposer(small_target, head="random").weights == "target"
    assert EagleProposer(small_target, head="random", weights="int8").weights == "int8"  # the option wins
    machine.forget()
    monkeypatch.setenv(machine.OVERRIDE_ENV, "int8_drafting=int8")
    assert EagleProposer(small_target, head="random").weights == "int8"
    assert EagleProposer(small_target, head="random", weights="target").weights == "target"


def test_one_row_copies_are_kept_only_where_the_machine_chose_them(tiny_dirs, monkeypatch):
    import specplug

    draft = specplug.Target.from_pretrained(tiny_dirs["draft"], lean=False)
    monkeypatch.setenv(machine.OVERRIDE_ENV, "one_row_copies=few_rows")
    lean, why = lean_or_reason(draft.model, one_row_copies=True)
    assert lean is not None, why
    assert all(p.one_row is None for layer in lean.layers for p in layer.products())
    monkeypatch.setenv(machine.OVERRIDE_ENV, f"one_row_copies={COPY}")
    lean, _ = lean_or_reason(draft.model, one_row_copies=True)
    assert all(p.one_row is not None for layer in lean.layers for p in layer.products())


@pytest.mark.parametrize("form", [few_rows.TRANSPOSED, "F.linear"])
def test_either_float32_form_keeps_one_row_bits_where_the_probe_says_so(form, monkeypatch):
    """The target's float32 products take one form per kind of weight, for every row count, so a verify pass
    and a one-token step round alike in either form (wherever the probe finds identical rows)."""
    monkeypatch.setenv(machine.OVERRIDE_ENV, f"few_rows_float32={form}")
    few_rows.forget_probes()
    weight = torch.randn(96, 64)
    assert few_rows.transposed(weight) == (form == few_rows.TRANSPOSED)
    n = few_rows.identical_rows(weight)
    x = torch.randn(2 * n + 3, 64)
    rows = torch.cat([few_rows.linear(x[i:i + 1], weight) for i in range(x.shape[0])])
    if n > 1:
        assert torch.equal(few_rows.linear(x, weight), rows)
    torch.testing.assert_close(few_rows.linear(x, weight), x @ weight.T, atol=1e-5, rtol=1e-5)
    few_rows.forget_probes()
