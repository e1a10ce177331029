"""The planner's inputs as people write them: parameter counts (``70B``), bandwidths (``400GB/s``,
``200Gbit``), memory sizes (``80GB``), and a transformer's shape (``{"layers", "hidden", "vocab"}``) turned into
its parameter count. Pure parsing: nothing here knows the arms or the formulas."""

from __future__ import annotations

import re

_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
# Rates are quoted in decimal units by NIC and link vendors (400 GB/s NVLink, 200 Gbit/s InfiniBand).
_DECIMAL = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_BINARY = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
_NUMBER = r"(?P<num>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)"
_UNIT = re.compile(r"(?P<prefix>[kKmMgGtTpP]?)(?P<binary>i?)(?P<base>bits?|bytes?|b|B)(?P<per>/s|/sec|ps)?",
                   re.IGNORECASE)


def parse_count(text: str) -> int:
    """A parameter count: ``7e9``, ``70B``, ``1.3M``, ``350k``, ``1_000_000`` (B/G = 10^9, T = 10^12)."""
    match = re.fullmatch(_NUMBER + r"\s*(?P<suffix>[kKmMbBgGtT]?)", str(text).strip().replace("_", "").replace(",", ""))
    if not match:
        raise ValueError(f"not a parameter count: {text!r} (examples: 7e9, 70B, 1.3M)")
    value = round(float(match["num"]) * _COUNT_SUFFIX[match["suffix"].upper()])
    if value < 1:
        raise ValueError(f"parameter count must be >= 1, got {text!r}")
    return value


def _split_unit(text: str, what: str, example: str) -> tuple[float, re.Match]:
    match = re.fullmatch(_NUMBER + r"\s*(?P<unit>\S+)", str(text).strip())
    unit = _UNIT.fullmatch(match["unit"]) if match else None
    if unit is None:
        raise ValueError(f"not a {what}: {text!r}; give a number and a unit, e.g. {example}")
    return float(match["num"]), unit


def _is_bits(base: str) -> bool:
    # "b" is a bit and "B" a byte (IEC/SI convention); spelled-out names are unambiguous in any case.
    return base == "b" or base.lower() in ("bit", "bits")


def parse_bandwidth(text: str) -> float:
    """Bytes per second from ``400GB/s``, ``200Gbit``, ``200Gbps``, ``100Gb/s``, ``25GiB/s``.

    ``B``/``byte`` are bytes and ``b``/``bit`` bits (divided by 8); prefixes are decimal (G = 10^9) unless written
    ``Ki``/``Mi``/``Gi``/``Ti``. The ``/s`` is optional.
    """
    number, unit = _split_unit(text, "bandwidth", "400GB/s or 200Gbit")
    scale = (_BINARY if unit["binary"] else _DECIMAL)[unit["prefix"].upper()]
    value = number * scale / (8 if _is_bits(unit["base"]) else 1)
    if value <= 0:
        raise ValueError(f"bandwidth must be > 0, got {text!r}")
    return value


def parse_memory(text: str) -> int:
    """Bytes from ``80GB``, ``64GiB``, ``40000MB``.

    Memory sizes use binary multiples for both ``GB`` and ``GiB`` (drivers and torch report device memory
    that way), the convention of ``async_hzp.memory_budget_gb``
    (:data:`ds_asynchzp.formulas.sizing.BYTES_PER_GB`). Bits are rejected.
    """
    number, unit = _split_unit(text, "memory size", "80GB")
    if _is_bits(unit["base"]) or unit["per"]:
        raise ValueError(f"{text!r} is not a memory size in bytes; e.g. 80GB")
    value = int(number * _BINARY[unit["prefix"].upper()])
    if value <= 0:
        raise ValueError(f"memory size must be > 0, got {text!r}")
    return value


def params_from_model_spec(spec: dict) -> int:
    """Parameter count of a decoder-only transformer from ``{"layers", "hidden", "vocab", "ffn_hidden"?, "tied"?}``.

    Ψ ≈ L·(4h² + 2·h·f) + V·h·(1 if tied else 2), f = ffn_hidden (default 4h, which gives the usual 12·L·h²):
    attention q, k, v, o projections (4h²), a two-matrix MLP (2·h·f), the token embedding, and an output head
    unless it is tied to the embedding. Biases, norms and position tables (< 0.1 % at scale) are left out. For a
    gated MLP (SwiGLU: three h×f matrices) pass ffn_hidden = 1.5·f. ``tied`` defaults to false.
    """
    unknown = set(spec) - {"layers", "hidden", "vocab", "ffn_hidden", "tied"}
    if unknown:
        raise ValueError(f"model spec has unknown keys {sorted(unknown)}")
    try:
        layers, hidden, vocab = (int(spec[k]) for k in ("layers", "hidden", "vocab"))
    except KeyError as missing:
        raise ValueError(f"model spec lacks {missing}; it needs layers, hidden and vocab") from None
    ffn = int(spec.get("ffn_hidden") or 4 * hidden)
    if min(layers, hidden, vocab, ffn) < 1:
        raise ValueError(f"model spec sizes must be >= 1: {spec}")
    tied = spec.get("tied", False)
    if not isinstance(tied, bool):  # a string "false" would otherwise count as tied
        raise ValueError(f'model spec "tied" must be true or false, got {tied!r}')
    heads = 1 if tied else 2
    return layers * (4 * hidden * hidden + 2 * hidden * ffn) + heads * vocab * hidden
