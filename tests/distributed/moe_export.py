"""Mixture-of-Experts checkpoints written on two ranks export in the Hub's layout (jobs of the 2-rank launch of
``test_deferred_init.py``; the single-process export is ``tests/unit/test_export_moe.py``).

Qwen3-MoE and DeepSeek-V3 train under dp2 ep2 (each rank holds half of every experts tensor) and Mixtral under tp2
(no ep), each saving its checkpoint at the end (``full`` or ``sharded``). Every job must train as one device does
(the launch's own check); here each checkpoint is exported (``lightning_parallel.checkpoint.export``) and must hold
what ``save_pretrained`` of the trained model writes (per-expert modules under the Hub's names, bitwise), and
``from_pretrained`` of it must hold the trained full state bitwise and give the same logits. Mixtral under dp2 ep2
and Qwen2-MoE exports through ``test_transformers.assert_exports_for_serving``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.harness import JobSpec

STEPS = 3
#: job name -> (family, strategy, strategy options incl. the checkpoint's format)
JOBS = {
    "export_qwen3_moe_dp2_ep2": ("qwen3_moe", "hybrid", {"data_parallel_size": 2, "expert_parallel_size": 2, "save_format": "full"}),
    "export_deepseek_v3_dp2_ep2": ("deepseek_v3", "hybrid", {"data_parallel_size": 2, "expert_parallel_size": 2, "save_format": "sharded"}),
    "export_mixtral_tp2": ("mixtral", "tensor", {"save_format": "sharded"}),
}


def export_jobs() -> dict[str, tuple[JobSpec, dict]]:
    """name -> (the job, the arguments of its single-device reference in ``test_deferred_init.reference``)."""
    jobs = {}
    for name, (family, strategy, options) in JOBS.items():
        dp = options.get("data_parallel_size", 1)
        # Built eagerly in float64 (empty_init=False), as the launch's references build theirs.
        spec = JobSpec(model=f"hf_{family}", strategy=strategy, devices=2, batch_size=4 // dp, steps=STEPS, empty_init=False,
                       checkpoint_round_trip=True, strategy_kwargs={"timeout": 120, **options})
        jobs[name] = (spec, {"model": f"hf_{family}"})
    return jobs


def assert_exports(results: dict[str, dict], tmp_path: Path) -> None:
    """Each job's checkpoint exports to what ``save_pretrained`` writes and loads as the trained model (module doc)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lightning_parallel.checkpoint.export import export
    from tests.export_sweep import compare_loaded
    from tests.hf_models import VOCAB, make_hf_model

    for name, (family, _, options) in JOBS.items():
        trained = results[name]["states"][-1]
        if options.get("expert_parallel_size"):  # the experts were divided while training: half on each rank
            experts = [n for n in trained if n.endswith(".experts.gate_up_proj")]
            assert experts and all(results[name]["local_numel"][n] * 2 == trained[n].numel() for n in experts), name
        plain = make_hf_model(family).double()
        plain.load_state_dict(trained)  # strict: every name, whole shapes
        net = plain.net.eval()
        out = tmp_path / name / "hf"
        export(tmp_path / name / "final.ckpt", out, config=net.config)
        net.save_pretrained(tmp_path / name / "save_pretrained")
        exported, expected = load_file(out / "model.safetensors"), load_file(tmp_path / name / "save_pretrained" / "model.safetensors")
        assert exported.keys() == expected.keys() and any(".experts.0." in n for n in exported), (name, sorted(exported)[:5])
        assert all(torch.equal(exported[n], expected[n]) for n in expected), name
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, experts_implementation="eager").eval()
        wrong, _ = compare_loaded(net, loaded)  # bitwise (DeepSeek-V3's float32 router rounded as it loads)
        assert not wrong, (name, wrong)
        tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=tokens).logits, net(input_ids=tokens).logits), name
