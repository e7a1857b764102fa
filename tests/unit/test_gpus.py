"""The GPU catalogue (lightning_parallel/plan/gpus.py), its hardware profiles, and gpu_check's use of them (no GPU)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_parallel.conf import CONFIG_DIR
from lightning_parallel.plan.gpus import GPUS, UnknownGPUError, find_gpu, gpu_spec
from lightning_parallel.plan.hardware import HardwareProfile

CONF = Path(__file__).resolve().parents[2] / "conf"

#: What torch.cuda.get_device_name() reports -> the catalogue's key.
NAMES = {
    "NVIDIA H100 80GB HBM3": "h100_sxm",
    "NVIDIA H100 PCIe": "h100_pcie",
    "NVIDIA H100 NVL": "h100_nvl",
    "NVIDIA H200": "h200_sxm",
    "NVIDIA H200 NVL": "h200_nvl",
    "NVIDIA A100-SXM4-80GB": "a100_sxm4_80gb",
    "NVIDIA A100-SXM4-40GB": "a100_sxm4_40gb",
    "NVIDIA A100 80GB PCIe": "a100_pcie_80gb",
    "NVIDIA A100-PCIE-40GB": "a100_pcie_40gb",
    "NVIDIA L40S": "l40s",
    "NVIDIA B200": "b200",
}


@pytest.mark.parametrize("name", list(NAMES))
def test_each_reported_name_is_recognised(name):
    assert find_gpu(name).key == NAMES[name] and gpu_spec(name) is GPUS[NAMES[name]]
    # Case and the separators CUDA versions spell differently do not matter.
    assert find_gpu(name.lower().replace("-", " ")).key == NAMES[name]


def test_the_catalogue_lists_each_name_once_and_recognises_every_name_it_lists():
    listed = [name for spec in GPUS.values() for name in spec.device_names]
    assert len(listed) == len(set(listed)) and set(NAMES) <= set(listed)
    assert all(find_gpu(name) is spec for spec in GPUS.values() for name in spec.device_names)


@pytest.mark.parametrize("name", ["NVIDIA H100", "NVIDIA L40", "NVIDIA A100-SXM4-80GB MIG 3g.40gb", "NVIDIA GeForce RTX 4090",
                                  "NVIDIA GH200 480GB", "NVIDIA H200 PCIe", ""])
def test_unknown_names_are_refused_never_taken_for_a_relative(name):
    assert find_gpu(name) is None
    with pytest.raises(UnknownGPUError, match=r"device_name=.*is not a GPU.*Fix: .*--peak-tflops") as caught:
        gpu_spec(name)
    assert isinstance(caught.value, ValueError) and caught.value.device_name == name
    with pytest.raises(TypeError, match="must be a str"):
        find_gpu(None)  # type: ignore[arg-type]


def test_each_gpu_has_its_own_peak_and_memory():
    h100, pcie, nvl, h200, b200 = (GPUS[k] for k in ("h100_sxm", "h100_pcie", "h100_nvl", "h200_sxm", "b200"))
    assert (h100.peak_tflops("bf16"), pcie.peak_tflops("bf16"), nvl.peak_tflops("bf16")) == (989, 756, 835)
    assert (h200.peak_tflops("bf16"), h200.memory_gb, h200.memory_gbps) == (989, 141, 4800)
    assert (h100.memory_gb, h100.memory_gbps, h100.nvlink_gbps) == (80, 3350, 450)
    assert (b200.peak_tflops("bf16"), b200.memory_gb, b200.nvlink_gbps) == (2250, 180, 900)
    assert GPUS["a100_sxm4_40gb"].memory_gb == 40 and GPUS["a100_sxm4_80gb"].peak_tflops("bf16") == 312
    assert GPUS["l40s"].nvlink_gbps is None and GPUS["l40s"].peak_tflops("bf16") == pytest.approx(362.05)
    # float32 matmuls: CUDA cores by default (torch's allow_tf32=False), TF32 tensor cores when allowed.
    assert (h100.peak_tflops("fp32"), h100.peak_tflops("fp32", tf32=True)) == (67, 494.7)
    with pytest.raises(ValueError, match="no fp64 peak"):
        GPUS["l40s"].peak_tflops("fp64")
    with pytest.raises(ValueError, match="dtype='fp8' is not one of"):
        h100.peak_tflops("fp8")
    for spec in GPUS.values():  # dense, never the datasheet's sparse figure
        assert spec.fp16_tflops == spec.bf16_tflops and spec.tf32_tflops * 2 == pytest.approx(spec.bf16_tflops, rel=0.03)


@pytest.mark.parametrize("spec", [s for s in GPUS.values() if s.profile], ids=lambda s: s.key)
def test_each_gpus_profile_loads_and_carries_its_figures(spec):
    profile = HardwareProfile.from_config(yaml.safe_load((CONFIG_DIR / "hardware" / f"{spec.profile}.yaml").read_text()))
    assert profile.name == spec.profile and profile.device_memory_gib == spec.memory_gb
    assert profile.peak_dtype == "bf16" and profile.peak_tflops == pytest.approx(spec.bf16_tflops, rel=1e-3)
    for dtype, peak in (profile.peak_tflops_by_dtype or {}).items():
        assert peak == pytest.approx(spec.profile_peaks()[dtype], rel=1e-3), dtype
    if spec.nvlink_gbps is not None and spec.key.endswith(("sxm", "b200")):
        assert profile.intra_node_gbps == spec.nvlink_gbps


@pytest.mark.parametrize("name", ["h200_ib", "h100_pcie", "b200_ib"])
def test_new_hardware_profiles_compose_as_hydra_options(name):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"hardware={name}"])
    profile = HardwareProfile.from_config(OmegaConf.to_container(cfg.hardware, resolve=True))
    assert profile.name == name and profile.peak_flops("bf16", 8) > 0 and profile.peak_flops("fp32", 8) > 0
    assert profile.usable_memory_bytes < profile.device_memory_gib * 2**30


def test_gpu_check_calibrates_each_gpu_with_its_own_profile():
    from benchmarks.gpu_check import CALIBRATING_VARIANT, calibrated_profile

    name, text = calibrated_profile({CALIBRATING_VARIANT: {"mfu": 0.45, "device": "NVIDIA H200"}}, smoke=False)
    profile = HardwareProfile.from_config(yaml.safe_load(text))
    assert name == "h200_ib_calibrated.yaml" and profile.device_memory_gib == 141 and profile.achievable_fraction == 0.45
    name, _ = calibrated_profile({CALIBRATING_VARIANT: {"mfu": 0.45, "device": "NVIDIA H100 PCIe"}}, smoke=False)
    assert name == "h100_pcie_calibrated.yaml"
    # Known, but no profile of its own yet: nothing written (never another GPU's profile).
    assert calibrated_profile({CALIBRATING_VARIANT: {"mfu": 0.45, "device": "NVIDIA H100 NVL"}}, smoke=False) is None


def test_gpu_check_stops_without_a_gpu_before_training_anything(monkeypatch, tmp_path, capsys):
    from benchmarks.gpu_check import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "no CUDA GPU" in error and "--smoke" in error  # and it names the CPU smoke test
    assert not any(tmp_path.iterdir())


def test_gpu_check_refuses_an_unknown_gpu_unless_given_its_peak(monkeypatch):
    from benchmarks.gpu_check import GPUCheckError, gpu_info

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=24 * 2**30, major=8, minor=9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA GeForce RTX 4090")
    with pytest.raises(GPUCheckError, match=r"'NVIDIA GeForce RTX 4090' is not a GPU.*--peak-tflops"):
        gpu_info(None)
    assert gpu_info(165.0)["catalogue"] is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    info = gpu_info(None)
    assert info["catalogue"]["profile"] == "h200_ib" and info["catalogue"]["memory_gb"] == 141


def test_gpu_check_report_and_status_count_skipped_variants_and_mismatched_layouts():
    from benchmarks.gpu_check import failed, write_report
    from benchmarks.gpu_layouts import compare

    reference = {"losses": [4.8, 4.7]}
    layouts = {"dp2": compare({"losses": [4.8, 4.7], "layout": "dp=2", "backend": "cuda:gloo", "world_size": 2}, reference),
               "tp2": compare({"losses": [4.8, 4.71], "layout": "tp=2", "backend": "cuda:gloo", "world_size": 2}, reference),
               "pp2": compare({"error": "exit -11: Segmentation fault"}, reference),
               "cp2": compare({"losses": [4.8]}, {"error": "exit 1: CUDA error"})}
    assert layouts["dp2"]["match"] and not layouts["tp2"]["match"]
    assert layouts["tp2"]["max_relative_difference"] == pytest.approx(0.01 / 4.7)
    assert "reference failed: exit 1" in layouts["cp2"]["error"]
    variant = {"variant": "v", "step_s": 0.3, "monitor_step_s": 0.29, "first_steps_s": 9.0, "tokens_per_s": 27000.0,
               "mfu": 0.42, "peak_memory_gib": 30.2, "predicted_peak_memory_gib": 33.0, "hardware": "h100_ib",
               "device": "NVIDIA H100 80GB HBM3"}
    results = {"device": None, "wall_s": 400.0, "layouts": {"dp2": layouts["dp2"]},
               "variants": {"ours + compile": variant, "ours + activation checkpointing": {"variant": "a", "error": "skipped: 9 s left"}}}
    report = write_report(results, smoke=False)
    assert "| ours + compile | 0.3000 | 0.2900 |" in report and "| 42.0% | 30.2 | 33 |" in report
    assert "goal ≥ 40%: met" in report and "| ours + activation checkpointing | skipped: 9 s left |" in report
    assert "| dp2 (dp=2, cuda:gloo) | match |" in report
    assert failed(results)  # the skipped variant
    results["variants"].pop("ours + activation checkpointing")
    assert not failed(results)
    results["layouts"] = layouts
    assert failed(results) and "| tp2 (tp=2, cuda:gloo) | MISMATCH |" in write_report(results, smoke=False)
