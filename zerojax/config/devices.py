"""The device kinds `zerojax plan` estimates step times for and the train loop's MFU divides by,
what JAX may use of a card, and sizes such as 24GB. Pure arithmetic: this module imports no
jax. It sits in `config`, below `train` and `analysis`, because both read it (and the CLI's
`--device` choices are its names, as the other choices are `rules`').

Each kind's figures, per device (one GPU, one TPU chip), from the vendors' datasheets:
    peak_flops   dense bf16 tensor FLOP/s (no sparsity)
    hbm_bw       device memory bandwidth, bytes/s
    link_bw      one direction of the device's own interconnect inside a host (NVLink, ICI;
                 PCIe where the card has none), bytes/s
    host_bw      one direction of the host link (PCIe), bytes/s: what zero.offload streams over
    network_bw   one direction of the network each device has to other hosts, bytes/s

Sources:
    H100 SXM   NVIDIA H100 Tensor Core GPU datasheet (2023): 989 TFLOPS bf16 dense, 80 GB HBM3,
               3.35 TB/s, NVLink 900 GB/s (both directions), PCIe Gen5 x16 (64 GB/s); DGX H100:
               one ConnectX-7 400 Gb/s NIC per GPU.
    H200 SXM   NVIDIA H200 datasheet (2024): 989 TFLOPS, 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s,
               PCIe Gen5 x16; HGX H200 as DGX H100: 400 Gb/s per GPU.
    A100 SXM   NVIDIA A100 datasheet (2021): 312 TFLOPS bf16, 40 GB at 1,555 GB/s or 80 GB at
               2,039 GB/s, NVLink 600 GB/s (both directions), PCIe Gen4 x16 (32 GB/s); DGX A100:
               one 200 Gb/s HDR NIC per GPU.
    L40S       NVIDIA L40S datasheet (2023): 362 TFLOPS bf16 dense (733 with sparsity), 48 GB GDDR6
               at 864 GB/s, no NVLink: peers and host over PCIe Gen4 x16 (32 GB/s); network
               assumed one 100 Gb/s NIC per GPU.
    RTX 4090   NVIDIA Ada Lovelace architecture whitepaper (2022), appendix table: 165.2 TFLOPS
               bf16 with fp32 accumulate, 24 GB GDDR6X at 1,008 GB/s, PCIe Gen4 x16 (32 GB/s)
               for peers (no NVLink, no peer-to-peer: through the host) and host; network assumed
               one 100 Gb/s NIC per GPU.
    TPU v5e    Google Cloud TPU v5e documentation: 197 TFLOPS bf16, 16 GB HBM2 at 819 GB/s, ICI
               1,600 Gb/s per chip; the host link is not published: PCIe Gen4 x16 assumed.
    TPU v5p    Google Cloud TPU v5p documentation: 459 TFLOPS bf16, 95 GB HBM2e at 2,765 GB/s, ICI
               4,800 Gb/s per chip; host link assumed PCIe Gen4 x16. Inside a pod the hosts' chips
               are joined by ICI: the network is the ICI.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from zerojax.errors import ConfigError


GB, GIB = 1e9, 2**30
DEFAULT_MEM_FRACTION = 0.75  # JAX preallocates this share of a GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION)


@dataclass(frozen=True)
class Device:
    """One device kind: the figures the step-time estimate needs (see the module docstring)."""

    name: str
    peak_flops: float
    memory_bytes: float
    hbm_bw: float
    link_bw: float
    host_bw: float
    network_bw: float


DEVICES = {d.name: d for d in (
    Device("h100", 989e12, 80 * GB, 3.35e12, 450e9, 64e9, 50e9),
    Device("h200", 989e12, 141 * GB, 4.8e12, 450e9, 64e9, 50e9),
    Device("a100-40", 312e12, 40 * GB, 1.555e12, 300e9, 32e9, 25e9),
    Device("a100-80", 312e12, 80 * GB, 2.039e12, 300e9, 32e9, 25e9),
    Device("l40s", 362e12, 48 * GB, 864e9, 32e9, 32e9, 12.5e9),
    Device("4090", 165.2e12, 24 * GB, 1.008e12, 32e9, 32e9, 12.5e9),
    Device("tpu-v5e", 197e12, 16 * GB, 819e9, 200e9, 32e9, 200e9),
    Device("tpu-v5p", 459e12, 95 * GB, 2.765e12, 600e9, 32e9, 600e9),
)}


def device(name: str) -> Device:
    if name not in DEVICES:
        raise ConfigError(f"--device {name!r} is not a known device kind; choose one of {', '.join(DEVICES)}")
    return DEVICES[name]


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*(gib|gb|g|mib|mb|m|tib|tb|t)?\s*$", re.IGNORECASE)
_UNITS = {"g": GB, "gb": GB, "gib": GIB, "m": 1e6, "mb": 1e6, "mib": 2**20, "t": 1e12, "tb": 1e12, "tib": 2**40}


_KINDS = (("h200", "H200"), ("h100", "H100"), ("a100-80", "A100-SXM4-80GB"), ("a100-80", "A100 80GB"),
          ("a100-40", "A100"), ("l40s", "L40S"), ("4090", "RTX 4090"), ("tpu-v5e", "TPU v5 lite"),
          ("tpu-v5e", "TPU v5e"), ("tpu-v5p", "TPU v5p"), ("tpu-v5p", "TPU v5"))


def from_device_kind(kind: str) -> Device | None:
    """The table's entry for a jax `device.device_kind` ("NVIDIA H100 80GB HBM3", "TPU v5 lite"),
    None for a kind it does not hold (the CPU, other cards): then no MFU is logged."""
    return next((DEVICES[name] for name, text in _KINDS if text.lower() in kind.lower()), None)


def parse_size(text: str, what: str = "--device-memory", zero: bool = False) -> float:
    """Bytes of a size: 24GB (10^9), 24GiB (2^30), 512MB, 80G; a bare number is GB."""
    m = _SIZE.match(str(text))
    value = float(m.group(1)) * _UNITS[(m.group(2) or "gb").lower()] if m else -1.0
    if not (value >= 0 if zero else value > 0):
        raise ConfigError(f"{what} {text!r} is not a size; use e.g. 24GB, 24GiB, 80G or 512MB")
    return value


def mem_fraction() -> float:
    """What JAX may use of a device: XLA_PYTHON_CLIENT_MEM_FRACTION, else its default 0.75."""
    text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    try:
        value = float(text) if text else DEFAULT_MEM_FRACTION
    except ValueError:
        value = 0.0
    if not 0 < value <= 1:
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r} must be a fraction in (0, 1]")
    return value


def budget_bytes(memory_bytes: float, margin_bytes: float, fraction: float | None = None) -> float:
    """Per-device bytes a step may peak at: JAX's share of the card, less the stated margin."""
    budget = (mem_fraction() if fraction is None else fraction) * memory_bytes - margin_bytes
    if budget <= 0:
        raise ConfigError(f"--margin {margin_bytes / GB:g} GB leaves nothing of the {memory_bytes / GB:g} GB device "
                          f"(JAX may use {(mem_fraction() if fraction is None else fraction):g} of it); "
                          "lower the margin")
    return budget


def step_seconds(dev: Device, flops: float, comm_bytes: float, hbm_bytes: float, host_bytes: float,
                 overlap: bool, hosts: int = 1) -> dict:
    """A roofline estimate of one step per device: dots at peak, collectives over the link (the
    network once the ring crosses hosts), the optimizer update's reads and writes at HBM speed
    and the offloaded state over the host link. With `overlap` (the unit schedule prefetching)
    collectives hide behind compute; the update and the host traffic follow the backward."""
    compute = flops / dev.peak_flops
    comm = comm_bytes / (dev.network_bw if hosts > 1 else dev.link_bw)
    update, host = hbm_bytes / dev.hbm_bw, host_bytes / dev.host_bw
    body = max(compute, comm) if overlap else compute + comm
    return {"step_s": body + update + host, "compute_s": compute, "comm_s": comm, "update_s": update, "host_s": host}
