"""A kernel whose rounding moves with the row count must be refused by its choice, and pinning it must fail."""
import pytest

from specplug import machine


def assert_drifting_rows_are_refused(monkeypatch, module, product_class, weight, default: str, pinned: str,
                                     beyond: int, scale: float) -> None:
    """Scale ``product_class``'s results by ``1 + scale`` beyond ``beyond`` rows: ``module.choose`` keeps the
    ``default`` form and says the rows differ; pinning the kernel form raises."""
    real = product_class.__call__

    def drifting(self, x):
        return real(self, x) * (1 + scale * (x.reshape(-1, x.shape[-1]).shape[0] > beyond))

    monkeypatch.setattr(product_class, "__call__", drifting)
    assert module.choose(weight) is None
    [choice] = [c for c in machine.machine_choices() if c.name == module.CHOICE]
    assert choice.value == default and "differ" in choice.why
    monkeypatch.setenv(machine.OVERRIDE_ENV, f"{module.CHOICE}={pinned}")
    with pytest.raises(ValueError, match="rows differ"):
        module.choose(weight)
