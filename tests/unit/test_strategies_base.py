"""What every strategy does (strategies/base.py) and ``ddp`` on a one-process gloo group
(strategies/ddp.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpexp import strategies
from ddpexp.runtime.dist import DistContext
from ddpexp.strategies.base import Local, _by_name, _optimizer_by_name, debug_modes
from ddpexp.strategies.ddp import DDP
from ddpexp.strategies.dp import DataParallel

CTX = DistContext()


def test_for_config_picks_class(trainer_config):
    assert type(strategies.for_config(trainer_config(strategy="single"), CTX)) is Local
    assert type(strategies.for_config(trainer_config(strategy="dp"), CTX)) is DataParallel
    assert type(strategies.for_config(trainer_config(strategy="ddp"), CTX)) is DDP
    assert type(strategies.for_config(trainer_config(strategy="fsdp"), CTX)).__name__ == "FSDP"


def test_local_wrap_is_identity_on_cpu(trainer_config, tiny_model):
    for s in (Local(trainer_config(strategy="single"), CTX),
              DataParallel(trainer_config(strategy="dp"), CTX)):
        assert s.wrap(tiny_model) is tiny_model and not s.sharded


def test_sync_batchnorm_ignored_with_warning(trainer_config, tiny_model, caplog):
    s = Local(trainer_config(strategy="single", sync_batchnorm=True), CTX)
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        assert s.prepare(tiny_model) is tiny_model
    assert "trainer.sync_batchnorm ignored: one process (strategy=single, cpu)" in caplog.text


def test_clip_returns_norm_before_clipping(trainer_config):
    s = Local(trainer_config(), CTX)
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    norm = s.clip([p], 1.0)
    assert float(norm) == pytest.approx(5.0)
    assert p.grad.tolist() == pytest.approx([0.6, 0.8], rel=1e-5)


def test_grad_norm(trainer_config):
    s = Local(trainer_config(), CTX)
    a, b = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    assert s.grad_norm([a, b]) is None
    a.grad = torch.tensor([6.0])
    b.grad = torch.tensor([8.0])
    assert float(s.grad_norm([a, b])) == pytest.approx(10.0)


def test_all_finite(trainer_config, tiny_model):
    s = Local(trainer_config(), CTX)
    assert s.all_finite(tiny_model)
    with torch.no_grad():
        tiny_model[0].weight[0, 0] = float("inf")
    assert not s.all_finite(tiny_model)


def test_eval_batches_counts_every_batch(trainer_config):
    s = Local(trainer_config(), CTX)
    assert list(s.eval_batches([1, 2, 3])) == [(1, True), (2, True), (3, True)]


def test_save_writes_last_and_copies(trainer_config, tmp_path, tiny_model):
    s = Local(trainer_config(), CTX)
    state = {"model": tiny_model.state_dict(), "step": 3}
    last, best = tmp_path / "c" / "last.pt", tmp_path / "c" / "best.pt"
    last.parent.mkdir()
    s.save(state, last, [best])
    for path in (last, best):
        loaded = torch.load(path, weights_only=True)
        assert loaded["step"] == 3 and torch.equal(loaded["model"]["0.weight"], tiny_model[0].weight)
    s.save(None, tmp_path / "none.pt")
    assert not (tmp_path / "none.pt").exists()


def test_load_optimizer_by_index_and_by_name(trainer_config, tiny_model):
    s = Local(trainer_config(), CTX)
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1, momentum=0.9)
    tiny_model(torch.randn(2, 4)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    by_name = _optimizer_by_name(tiny_model, opt, saved)
    assert list(by_name["state"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert by_name["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert _by_name(by_name) and not _by_name(saved)
    assert _optimizer_by_name(tiny_model, opt, by_name) is by_name
    fresh = torch.optim.SGD(tiny_model.parameters(), lr=0.5, momentum=0.9)
    s.load_optimizer(tiny_model, fresh, saved)
    assert fresh.param_groups[0]["lr"] == 0.1
    assert torch.equal(fresh.state_dict()["state"][0]["momentum_buffer"],
                       saved["state"][0]["momentum_buffer"])


def test_load_full_weights_and_snapshot(trainer_config, tiny_model):
    s = Local(trainer_config(), CTX)
    snap = s.snapshot(tiny_model)
    with torch.no_grad():
        for p in tiny_model.parameters():
            p.add_(1.0)
    assert not torch.equal(snap["0.weight"], tiny_model[0].weight)
    s.load_full_weights(tiny_model, snap)
    assert torch.equal(snap["0.weight"], tiny_model[0].weight)
    s.load_full_weights(tiny_model, None)  # another rank's call: nothing to load


def test_debug_modes_restore_torch_settings(trainer_config):
    before = torch.are_deterministic_algorithms_enabled()
    with debug_modes(trainer_config(deterministic=True, detect_anomaly=True)):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_anomaly_enabled()
    assert torch.are_deterministic_algorithms_enabled() == before
    assert not torch.is_anomaly_enabled()


def test_checkpoint_activations_only_when_asked(trainer_config, caplog):
    from ddpexp.models import GPT

    m = GPT(vocab_size=5, block_size=4, n_layer=2, n_head=1, n_embd=4)
    Local(trainer_config(), CTX).checkpoint_activations(m)
    assert caplog.text == ""
    with caplog.at_level(logging.INFO, logger="ddpexp"):
        Local(trainer_config(activation_checkpointing=True), CTX).checkpoint_activations(m)
    assert "activation checkpointing: 2 block(s) of GPT recomputed in backward" in caplog.text


def test_ddp_wraps_and_skips_sync(gloo_group, trainer_config, tiny_model):
    s = DDP(trainer_config(strategy="ddp"), CTX)
    assert s.prepare(tiny_model) is tiny_model  # no SyncBatchNorm on the CPU
    model = s.wrap(tiny_model)
    assert isinstance(model, DistributedDataParallel) and model.module is tiny_model
    x = torch.randn(3, 4)
    with s.no_sync(model, sync=False):
        model(x).sum().backward()
    with s.no_sync(model, sync=True):
        model(x).sum().backward()
    # one rank: the all-reduced gradient is the sum of both micro-batches' gradients
    ref = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    ref.load_state_dict(tiny_model.state_dict())
    (ref(x).sum() * 2).backward()
    assert torch.allclose(tiny_model[0].weight.grad, ref[0].weight.grad, atol=1e-6)


def test_ddp_state_is_unwrapped(gloo_group, trainer_config, tiny_model):
    s = DDP(trainer_config(strategy="ddp"), CTX)
    s.wrap(tiny_model)
    assert list(s.model_state(tiny_model)) == ["0.weight", "0.bias", "2.weight", "2.bias"]
