"""Jobs launched by the tests do not inherit what training in the test process left in its environment.

A Trainer run in the pytest process (a one-device ``DataParallelStrategy``) has Lightning's launcher set
``OMP_NUM_THREADS`` to cores // ranks, and ``seed_everything`` sets ``PL_GLOBAL_SEED``/``PL_SEED_WORKERS``. torchrun
gives each rank one thread only when ``OMP_NUM_THREADS`` is absent, so every launch after such a test ran its ranks on
more threads, and MKL's QR (``nn.init.orthogonal_``) rounds differently on 2 threads than on 1: RWKV's coverage
cells came out 5.4e-5 from their references only when the sample ran after those tests.
"""

import pytest
import torch

from tests import harness


def test_launched_jobs_get_the_starting_thread_count_not_the_one_training_left(monkeypatch):
    monkeypatch.setattr(harness, "_STARTING_THREADS", None)
    for name, value in {"OMP_NUM_THREADS": "2", "PL_GLOBAL_SEED": "1234", "PL_SEED_WORKERS": "1", "MASTER_PORT": "29500",
                        "LOCAL_RANK": "0", "SOMETHING_ELSE": "kept"}.items():
        monkeypatch.setenv(name, value)
    env = harness.launch_environment()
    assert not {"OMP_NUM_THREADS", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "MASTER_PORT", "LOCAL_RANK"} & set(env)
    assert env["SOMETHING_ELSE"] == "kept"
    monkeypatch.setattr(harness, "_STARTING_THREADS", "3")  # the user's own setting when the tests started
    assert harness.launch_environment()["OMP_NUM_THREADS"] == "3"
    assert harness.launch_environment(OMP_NUM_THREADS="1")["OMP_NUM_THREADS"] == "1"


def test_coverage_cells_initialise_alike_whatever_threads_the_process_had():
    """Reference and cells pin their thread count (THREADS) before the model is initialised: RWKV's embedding and head
    (``orthogonal_``, a 128x32 float32 QR) differ by up to 1.2e-7 when built on 2 threads and on 1 without it."""
    pytest.importorskip("transformers")
    from tests.coverage.cells import THREADS, build

    threads = torch.get_num_threads()
    states = []
    try:
        for count in (2, 1):
            torch.set_num_threads(count)
            model = build("causal_lm", "rwkv", None)[0]  # orthogonal_ init of its embedding and head
            assert torch.get_num_threads() == THREADS
            states.append({name: tensor.clone() for name, tensor in model.state_dict().items()})
    finally:
        torch.set_num_threads(threads)
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]), name
