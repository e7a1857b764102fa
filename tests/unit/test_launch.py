import os

import torch
import torch.distributed as dist

from lightning_parallel import training_job
from lightning_parallel.strategies.launch import _config_selection_flags


def test_config_selection_flags_are_forwarded_to_child_ranks():
    argv = ["--config-name", "other", "strategy=data", "-cp=conf2", "trainer.devices=2", "-m"]
    assert _config_selection_flags(argv) == ["--config-name", "other", "-cp=conf2"]
    assert _config_selection_flags(["trainer.devices=2"]) == []


def test_training_job_restores_the_launch_environment(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    with training_job():
        os.environ["LOCAL_RANK"] = "0"
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    assert "LOCAL_RANK" not in os.environ
    assert os.environ["MASTER_ADDR"] == "10.1.2.3"


def test_training_job_restores_the_thread_count_lightnings_launcher_chose(monkeypatch):
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    with training_job():
        # What Lightning's launcher does for a job of 1 process on this machine (when the variable is absent).
        _set_num_threads_if_needed(num_processes=1)
        assert "OMP_NUM_THREADS" in os.environ
        torch.set_num_threads(threads + 1)  # a count the job chose that the process must not keep
    assert "OMP_NUM_THREADS" not in os.environ
    assert torch.get_num_threads() == threads


def test_training_job_destroys_the_process_group_it_created(tmp_path):
    with training_job():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert not dist.is_initialized()
