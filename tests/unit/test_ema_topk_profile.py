"""The pieces behind trainer.ema_decay, trainer.save_top_k and trainer.profile_steps, each on
its own: the weight average, the top-k ranking and the step profiler."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from ddpexp.callbacks.ema import EMA, WeightAverage
from ddpexp.callbacks.profiler import StepProfiler
from ddpexp.checkpoint.topk import TopK
from ddpexp.errors import ConfigError


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _train(model: nn.Module, steps: int, ema: WeightAverage | None = None, seed: int = 1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if ema is not None:
            ema.update()


def test_ema_is_the_moving_average_and_copies_buffers():
    model = _net()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ema = WeightAverage(model, decay=0.9)
    expected = {k: v.clone() for k, v in start.items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        nn.functional.cross_entropy(model(torch.randn(16, 4)), torch.randint(0, 3, (16,))).backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        for name, value in model.state_dict().items():
            if name.endswith(("weight", "bias")):
                expected[name] = 0.9 * expected[name] + 0.1 * value
    avg = ema.averaged()
    assert avg.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        if name.endswith(("weight", "bias")):
            torch.testing.assert_close(avg[name], expected[name])
        else:  # running_mean, running_var, num_batches_tracked: copied
            assert torch.equal(avg[name], value), name
    assert avg["1.num_batches_tracked"].item() == 5
    assert not torch.equal(avg["3.weight"], model[3].weight)  # averaged, not the live weights
    assert ema.updates == 5


def test_ema_decay_zero_is_exactly_the_live_weights():
    plain, averaged = _net(), _net()
    ema = WeightAverage(averaged, decay=0.0)
    _train(plain, 7)
    _train(averaged, 7, ema)
    for name, value in plain.state_dict().items():
        assert torch.equal(ema.averaged()[name], value), name
        assert torch.equal(averaged.state_dict()[name], value), name


def test_ema_applied_swaps_in_and_back_and_loads_into_a_fresh_model():
    model = _net()
    ema = WeightAverage(model, decay=0.8)
    _train(model, 4, ema)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 4)
    fresh = _net()
    fresh.load_state_dict(ema.averaged())  # the averaged weights are a plain state dict
    fresh.eval()
    model.eval()
    with ema.applied():
        assert torch.equal(model(x), fresh(x))
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained[name]), f"{name} not restored"
    with pytest.raises(RuntimeError, match="boom"):
        with ema.applied():
            raise RuntimeError("boom")
    assert torch.equal(model.state_dict()["0.weight"], trained["0.weight"])


def test_ema_state_dict_resumes_exactly():
    """Train 6 steps in one go, or 3, save, restore into fresh objects and 3 more: the
    same average bit for bit."""
    whole = _net()
    ema_whole = WeightAverage(whole, 0.95)
    _train(whole, 3, ema_whole, seed=1)
    _train(whole, 3, ema_whole, seed=2)

    first = _net()
    ema_first = WeightAverage(first, 0.95)
    _train(first, 3, ema_first, seed=1)
    saved_model = {k: v.clone() for k, v in first.state_dict().items()}
    saved_ema = {**ema_first.state_dict(),
                 "averaged": {k: v.clone() for k, v in ema_first.state_dict()["averaged"].items()}}
    second = _net()
    second.load_state_dict(saved_model)
    ema_second = WeightAverage(second, 0.95)
    ema_second.load_state_dict(saved_ema)
    assert ema_second.updates == 3
    _train(second, 3, ema_second, seed=2)
    for name, value in ema_whole.averaged().items():
        assert torch.equal(ema_second.averaged()[name], value), name


def test_ema_ties_shared_weights():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    ema = WeightAverage(model, 0.5)
    avg = ema.averaged()
    assert avg["emb.weight"] is avg["head.weight"]
    fresh = Tied()
    fresh.load_state_dict(avg)


@pytest.mark.parametrize("decay", [1.0, -0.1, 1.5])
def test_ema_decay_out_of_range_is_refused(decay):
    with pytest.raises(ConfigError, match=r"trainer.ema_decay=.* must be in \[0, 1\)"):
        EMA(decay=decay)  # the callback, as callbacks.ema and trainer.ema_decay build it


def test_topk_keeps_the_best_and_says_what_to_delete():
    top = TopK(2, "val/acc", "max")
    assert top.offer(0.5, 0) == ("epoch000-val_acc-0.5.pt", [])
    assert top.offer(0.7, 1) == ("epoch001-val_acc-0.7.pt", [])
    assert top.offer(0.6, 2) == ("epoch002-val_acc-0.6.pt", ["epoch000-val_acc-0.5.pt"])
    assert top.offer(0.55, 3) == (None, [])  # not better than the worst kept
    assert top.offer(0.6, 4) == (None, [])  # a tie: the earlier one stays
    assert top.offer(float("nan"), 5) == (None, [])
    assert top.offer(0.9, 6) == ("epoch006-val_acc-0.9.pt", ["epoch002-val_acc-0.6.pt"])
    assert [e["epoch"] for e in top.kept] == [6, 1]


def test_topk_min_mode_and_a_smaller_k_after_resume():
    top = TopK(3, "val/loss", "min")
    for epoch, value in enumerate([0.9, 0.3, 0.5]):
        top.offer(value, epoch)
    state = top.state_dict()
    fewer = TopK(1, "val/loss", "min")
    fewer.load_state_dict(state)
    name, dropped = fewer.offer(0.4, 3)
    assert name is None
    assert dropped == ["epoch002-val_loss-0.5.pt", "epoch000-val_loss-0.9.pt"]
    assert [e["value"] for e in fewer.kept] == [0.3]


def test_topk_ranking_by_another_metric_starts_afresh(caplog):
    top = TopK(2, "val/acc", "max")
    top.offer(0.9, 0)
    other = TopK(2, "val/loss", "min")
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        other.load_state_dict(top.state_dict())
    assert other.kept == [] and "ranking starts afresh" in caplog.text


def test_topk_reconcile_with_the_disk(tmp_path, caplog):
    top = TopK(2, "val/acc", "max")
    for epoch, value in enumerate([0.5, 0.7]):
        name, _ = top.offer(value, epoch)
    (tmp_path / "epoch000-val_acc-0.5.pt").write_bytes(b"x")  # epoch 1's file never linked
    (tmp_path / "epoch009-val_acc-0.1.pt").write_bytes(b"x")  # not in the ranking
    (tmp_path / "last.pt").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        strays = top.reconcile(tmp_path)
    assert [e["name"] for e in top.kept] == ["epoch000-val_acc-0.5.pt"]
    assert "epoch001-val_acc-0.7.pt no longer on disk" in caplog.text
    assert strays == ["epoch009-val_acc-0.1.pt"]


def test_profiler_writes_a_chrome_trace_and_logs_top_operators(tmp_path, caplog):
    model = _net()
    with caplog.at_level(logging.INFO, logger="ddpexp"):
        prof = StepProfiler(steps=2, run_dir=tmp_path, skip=2)
        _train_steps_with(prof, model, 6)
        prof.close()
    trace = json.loads(prof.trace_path.read_text())
    assert prof.trace_path == tmp_path / "profile" / "trace.json"
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::addmm" in names  # the Linear layers' matmuls were recorded
    assert prof.table and "aten::" in prof.table
    assert "top operators by self cpu time total" in caplog.text


def test_profiler_run_too_short_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        prof = StepProfiler(steps=3, run_dir=tmp_path, skip=4)
        _train_steps_with(prof, _net(), 1)
        prof.close()
    assert "no trace written" in caplog.text
    assert not prof.trace_path.exists()


def _train_steps_with(prof: StepProfiler, model: nn.Module, steps: int) -> None:
    for i in range(steps):
        _train(model, 1, seed=i)
        prof.step()


def test_a_run_shorter_than_its_warmup_warms_up_over_all_but_its_last_step():
    from ddpexp.schedulers import cosine

    opt = torch.optim.SGD(_net().parameters(), lr=1.0)
    sched = cosine(opt, total_steps=3, steps_per_epoch=3, warmup_steps=50)
    lrs = []
    for _ in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == [0.5, 1.0, 1.0]  # warm-up over 2 steps, then the cosine from lr
