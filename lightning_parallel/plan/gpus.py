"""GPUs recognised by the name CUDA reports (``torch.cuda.get_device_name()``), each with its datasheet figures.

One entry per product: its dense peaks (no 2:4 sparsity: NVIDIA's datasheets print the sparse figure with an
asterisk, twice the dense one), its memory and memory bandwidth, its NVLink bandwidth where it has one, and the
hardware profile (``lightning_parallel/conf/hardware/<profile>.yaml``) with the same figures. A name is recognised only when it is one
of the names the product reports, exactly (case, ``-`` and ``_`` aside): an unknown name, a MIG slice (``... MIG
3g.40gb``, part of the GPU) or a plain ``H100`` are refused, never taken for their nearest relative, since a peak
off by a third makes every MFU wrong by as much. No torch here: callers pass the name.

Sources (dense = the datasheet's "with sparsity" figure / 2):

- H100 SXM / PCIe / NVL: NVIDIA H100 Tensor Core GPU datasheet (2024), and the H100 whitepaper's dense table
  (SXM5 BF16 989.4, TF32 494.7; PCIe BF16 756, TF32 378).
- H200 SXM / NVL: NVIDIA H200 Tensor Core GPU datasheet (2024): the SXM's compute is the H100 SXM's, with
  141 GB HBM3e at 4.8 TB/s; the NVL's is the H100 NVL's.
- A100: NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312, TF32 156, FP32 19.5, FP64 Tensor Core 19.5;
  memory bandwidth 1,555 GB/s (40 GB), 1,935 GB/s (80 GB PCIe), 2,039 GB/s (80 GB SXM).
- L40S: NVIDIA L40S datasheet (2023): BF16 362.05, TF32 183, FP32 91.6, 48 GB GDDR6 at 864 GB/s, no NVLink.
- B200: NVIDIA HGX B200 datasheet (2025, per GPU): FP16/BF16 4.5 PFLOPS sparse, TF32 2.2 PFLOPS sparse, FP32
  75 TFLOPS, FP64 37 TFLOPS, 180 GB HBM3e at 7.7 TB/s, NVLink 5 at 1.8 TB/s.

``fp32`` is the peak without TF32 (torch's default for float32 matmuls); ``fp64`` the FP64 Tensor Core figure
(cuBLAS runs float64 matmuls on them); NVLink bandwidths are per GPU in one direction (the datasheets print both
directions together: H100 SXM "900 GB/s" = 450 each way), as ``HardwareProfile.intra_node_gbps`` counts them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lightning_parallel.plan.dtypes import DTYPES


class UnknownGPUError(ValueError):
    """A device name the catalogue does not know: the message names the value, the known names, and the fix."""

    def __init__(self, device_name: str) -> None:
        self.device_name = device_name
        known = ", ".join(repr(name) for spec in GPUS.values() for name in spec.device_names)
        super().__init__(
            f"device_name={device_name!r} is not a GPU lightning_parallel knows (lightning_parallel/plan/gpus.py: "
            f"{known}). A MIG slice has only part of its GPU's compute and is not in it either. Fix: give the peak "
            f"yourself (benchmarks/gpu_check.py --peak-tflops, or a hardware profile like lightning_parallel/conf/hardware/*.yaml), or add the GPU to "
            f"GPUS with its datasheet's dense figures."
        )


@dataclass(frozen=True)
class GPUSpec:
    """One GPU product's datasheet figures.

    Args:
        key: Short name (``h100_sxm``).
        model: The product as NVIDIA names it.
        device_names: Names CUDA reports for it (``torch.cuda.get_device_name()``).
        bf16_tflops: Dense BF16 tensor-core peak, TFLOP/s.
        fp16_tflops: Dense FP16 tensor-core peak, TFLOP/s.
        tf32_tflops: Dense TF32 tensor-core peak, TFLOP/s (float32 matmuls with TF32 allowed).
        fp32_tflops: FP32 peak without tensor cores, TFLOP/s (torch's default for float32 matmuls).
        fp64_tflops: FP64 tensor-core peak, TFLOP/s; ``None`` where the datasheet gives none.
        memory_gb: Device memory as the datasheet labels it (the device reports about as many GiB).
        memory_gbps: Device memory bandwidth, GB/s.
        nvlink_gbps: NVLink bandwidth per GPU in one direction, GB/s; ``None``: no NVLink (PCIe only). On PCIe
            cards it is the bridge's, which joins pairs (or fours) of cards only.
        profile: The ``lightning_parallel/conf/hardware/<profile>.yaml`` with these figures, ``None`` where there is none yet.
    """

    key: str
    model: str
    device_names: tuple[str, ...]
    bf16_tflops: float
    fp16_tflops: float
    tf32_tflops: float
    fp32_tflops: float
    fp64_tflops: float | None
    memory_gb: float
    memory_gbps: float
    nvlink_gbps: float | None
    profile: str | None = None

    def peak_tflops(self, dtype: str, tf32: bool = False) -> float:
        """Dense peak in ``dtype`` (``bf16``, ``fp16``, ``fp32``, ``fp64``); ``fp32`` with ``tf32`` is the TF32
        tensor-core peak (``torch.backends.cuda.matmul.allow_tf32``).

        Raises:
            ValueError: ``dtype`` is unknown, or the datasheet gives no peak for it.
        """
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {list(DTYPES)}.")
        peak = {"bf16": self.bf16_tflops, "fp16": self.fp16_tflops, "fp32": self.tf32_tflops if tf32 else self.fp32_tflops,
                "fp64": self.fp64_tflops}[dtype]
        if peak is None:
            raise ValueError(f"{self.model}: its datasheet gives no {dtype} peak; pass the peak yourself.")
        return peak

    def profile_peaks(self) -> dict[str, float]:
        """Dense peaks by dtype as a hardware profile gives them (``fp32`` without TF32)."""
        peaks = {"bf16": self.bf16_tflops, "fp16": self.fp16_tflops, "fp32": self.fp32_tflops, "fp64": self.fp64_tflops}
        return {dtype: peak for dtype, peak in peaks.items() if peak is not None}


def _specs(*specs: GPUSpec) -> dict[str, GPUSpec]:
    return {spec.key: spec for spec in specs}


#: The catalogue, by key. Figures: see the module docstring's sources.
GPUS: dict[str, GPUSpec] = _specs(
    GPUSpec("h100_sxm", "H100 SXM5 80GB", ("NVIDIA H100 80GB HBM3",),
            bf16_tflops=989, fp16_tflops=989, tf32_tflops=494.7, fp32_tflops=67, fp64_tflops=67,
            memory_gb=80, memory_gbps=3350, nvlink_gbps=450, profile="h100_ib"),
    GPUSpec("h100_pcie", "H100 PCIe 80GB", ("NVIDIA H100 PCIe",),
            bf16_tflops=756, fp16_tflops=756, tf32_tflops=378, fp32_tflops=51, fp64_tflops=51,
            memory_gb=80, memory_gbps=2000, nvlink_gbps=300, profile="h100_pcie"),
    GPUSpec("h100_nvl", "H100 NVL 94GB", ("NVIDIA H100 NVL",),
            bf16_tflops=835, fp16_tflops=835, tf32_tflops=417.5, fp32_tflops=60, fp64_tflops=60,
            memory_gb=94, memory_gbps=3900, nvlink_gbps=300),
    GPUSpec("h200_sxm", "H200 SXM 141GB", ("NVIDIA H200",),
            bf16_tflops=989, fp16_tflops=989, tf32_tflops=494.7, fp32_tflops=67, fp64_tflops=67,
            memory_gb=141, memory_gbps=4800, nvlink_gbps=450, profile="h200_ib"),
    GPUSpec("h200_nvl", "H200 NVL 141GB", ("NVIDIA H200 NVL",),
            bf16_tflops=835, fp16_tflops=835, tf32_tflops=417.5, fp32_tflops=60, fp64_tflops=60,
            memory_gb=141, memory_gbps=4800, nvlink_gbps=450),
    GPUSpec("a100_sxm4_80gb", "A100 SXM4 80GB", ("NVIDIA A100-SXM4-80GB",),
            bf16_tflops=312, fp16_tflops=312, tf32_tflops=156, fp32_tflops=19.5, fp64_tflops=19.5,
            memory_gb=80, memory_gbps=2039, nvlink_gbps=300, profile="a100_ib"),
    GPUSpec("a100_sxm4_40gb", "A100 SXM4 40GB", ("NVIDIA A100-SXM4-40GB",),
            bf16_tflops=312, fp16_tflops=312, tf32_tflops=156, fp32_tflops=19.5, fp64_tflops=19.5,
            memory_gb=40, memory_gbps=1555, nvlink_gbps=300),
    GPUSpec("a100_pcie_80gb", "A100 PCIe 80GB", ("NVIDIA A100 80GB PCIe",),
            bf16_tflops=312, fp16_tflops=312, tf32_tflops=156, fp32_tflops=19.5, fp64_tflops=19.5,
            memory_gb=80, memory_gbps=1935, nvlink_gbps=300),
    GPUSpec("a100_pcie_40gb", "A100 PCIe 40GB", ("NVIDIA A100-PCIE-40GB",),
            bf16_tflops=312, fp16_tflops=312, tf32_tflops=156, fp32_tflops=19.5, fp64_tflops=19.5,
            memory_gb=40, memory_gbps=1555, nvlink_gbps=300),
    GPUSpec("l40s", "L40S 48GB", ("NVIDIA L40S",),
            bf16_tflops=362.05, fp16_tflops=362.05, tf32_tflops=183, fp32_tflops=91.6, fp64_tflops=None,
            memory_gb=48, memory_gbps=864, nvlink_gbps=None, profile="l40s_ethernet"),
    GPUSpec("b200", "B200 180GB (HGX)", ("NVIDIA B200",),
            bf16_tflops=2250, fp16_tflops=2250, tf32_tflops=1100, fp32_tflops=75, fp64_tflops=37,
            memory_gb=180, memory_gbps=7700, nvlink_gbps=900, profile="b200_ib"),
)


def _normalised(device_name: str) -> str:
    return " ".join(re.sub(r"[-_]", " ", device_name).casefold().split())


_BY_NAME = {_normalised(name): spec for spec in GPUS.values() for name in spec.device_names}


def find_gpu(device_name: str) -> GPUSpec | None:
    """The catalogue's entry for a CUDA device name (``None``: not one it knows)."""
    if not isinstance(device_name, str):
        raise TypeError(f"device_name must be a str (torch.cuda.get_device_name()), got {type(device_name).__name__}.")
    return _BY_NAME.get(_normalised(device_name))


def gpu_spec(device_name: str) -> GPUSpec:
    """The catalogue's entry for a CUDA device name.

    Raises:
        UnknownGPUError: A ValueError naming the device and how to give its figures instead.
    """
    spec = find_gpu(device_name)
    if spec is None:
        raise UnknownGPUError(device_name)
    return spec
