"""Every exception type of the package. Imports nothing from DeepSpeed or torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigIssue:
    """One problem: the JSON path of the key, what is wrong, and how to fix it."""

    key: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key}: {self.problem} Fix: {self.fix}"


class AsyncHZPConfigError(ValueError):
    """Invalid ds_config for AsyncHZP; the message names every offending key and its fix.

    Build with ``AsyncHZPConfigError(key, problem, fix)`` or with a list of
    :class:`ConfigIssue` so that independent problems are reported together.
    """

    def __init__(self, key_or_issues: str | list[ConfigIssue], problem: str = "", fix: str = ""):
        if isinstance(key_or_issues, str):
            issues = [ConfigIssue(key_or_issues, problem, fix)]
        else:
            issues = list(key_or_issues)
        self.issues: tuple[ConfigIssue, ...] = tuple(issues)
        if len(issues) == 1:
            message = str(issues[0])
        else:
            lines = "\n".join(f"  - {issue}" for issue in issues)
            message = f"ds_config is not valid for async_hzp ({len(issues)} problems):\n{lines}"
        super().__init__(message)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(issue.key for issue in self.issues)


class AsyncHZPNotActiveError(RuntimeError):
    """AsyncHZP was requested but the run would silently train with another optimizer."""


class DeepSpeedInternalsError(ImportError):
    """The installed DeepSpeed does not expose a private symbol this package needs."""


class CommTimeoutError(RuntimeError):
    """A wait on a collective ran past its timeout; the message names the collective and its group."""


class CommThreadError(RuntimeError):
    """A collective failed on a background communication thread. Raised on the training thread at its next wait
    on that thread's work, chained to the original exception (whose traceback shows where it failed)."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded as asked: missing, truncated or foreign files, another model, or another
    layout without conversion. The message names the file (or directory) and what is wrong with it; raised before
    any collective of the load, identically on every rank."""


class GradientMismatchError(RuntimeError):
    """Ranks of one gradient group reduced different parameters in the same backward: a parameter got a gradient
    on some ranks and none on others. Stock ZeRO-3 cannot train that either (its reduce-scatter sizes differ)."""


class PartitionWriteError(RuntimeError):
    """Code outside DeepSpeed rebound a parameter's partition (`param.ds_tensor.data = ...`) or wrote it in place, in a
    layout where the other ranks' copies of that partition cannot follow it without a collective (d_p < d_o, or
    d_o < the world)."""


class GradientReadMismatch(RuntimeError):
    """A read of the gradient state that needs the window's cross-node sum (a collective) was done by some ranks
    only (`scheduler/read_agreement.py`)."""
