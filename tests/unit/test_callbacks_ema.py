"""The moving average of the weights (callbacks/ema.py): avg = decay*avg + (1-decay)*param."""

from __future__ import annotations

import pytest
import torch
from helpers.tensors import small_net, train_steps
from torch import nn

from ddpexp.callbacks import EMA, ModelCheckpoint
from ddpexp.callbacks.ema import WeightAverage
from ddpexp.errors import ConfigError


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))


def test_update_is_lerp_towards_params():
    m = net()
    avg = WeightAverage(m, decay=0.9)
    start = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        m[0].weight.add_(1.0)
        m[1].running_mean.fill_(5.0)
    avg.update()
    got = avg.averaged()
    expected = 0.9 * start["0.weight"] + 0.1 * m[0].weight
    assert torch.allclose(got["0.weight"], expected, atol=1e-7)
    assert torch.equal(got["1.running_mean"], torch.full((2,), 5.0))  # buffers copied
    assert torch.equal(got["1.num_batches_tracked"], m[1].num_batches_tracked)
    assert avg.updates == 1


def test_two_updates_compound():
    m = net()
    avg = WeightAverage(m, decay=0.5)
    w0 = m[0].bias.detach().clone()
    with torch.no_grad():
        m[0].bias.fill_(2.0)
    avg.update()
    avg.update()
    assert torch.allclose(avg.averaged()["0.bias"], 0.25 * w0 + 0.75 * 2.0)


def test_decay_zero_is_exact_copy():
    m = net()
    avg = WeightAverage(m, decay=0.0)
    with torch.no_grad():
        m[0].weight.mul_(1.2345)
    avg.update()
    assert torch.equal(avg.averaged()["0.weight"], m[0].weight)


def test_applied_swaps_and_restores():
    m = net()
    avg = WeightAverage(m, decay=0.9)
    with torch.no_grad():
        m[0].weight.add_(1.0)
    trained = m[0].weight.detach().clone()
    with pytest.raises(RuntimeError, match="inside"), avg.applied():
        assert torch.equal(m[0].weight, avg.averaged()["0.weight"])
        raise RuntimeError("inside")
    assert torch.equal(m[0].weight, trained)


def test_tied_weights_share_one_average():
    from ddpexp.models import GPT

    m = GPT(vocab_size=7, block_size=4, n_layer=1, n_head=1, n_embd=4)
    avg = WeightAverage(m, decay=0.5).averaged()
    assert avg["head.weight"] is avg["tok.weight"]


def test_state_round_trip_and_missing_keys():
    m = net()
    a = WeightAverage(m, decay=0.9)
    with torch.no_grad():
        m[0].weight.add_(1.0)
    a.update()
    b = WeightAverage(net(), decay=0.99)
    b.load_state_dict(a.state_dict())
    assert b.updates == 1 and b.decay == 0.99
    assert torch.equal(b.averaged()["0.weight"], a.averaged()["0.weight"])
    with pytest.raises(KeyError, match="EMA state lacks 0.bias"):
        b.load_state_dict({"averaged": {k: v for k, v in a.averaged().items() if k != "0.bias"},
                           "updates": 1})


def test_ema_decay_checked():
    with pytest.raises(ConfigError, match=r"trainer.ema_decay=1.5 must be in \[0, 1\)"):
        EMA(decay=1.5)
    assert not EMA().enabled


def test_fit_saves_average_as_model_and_trained_as_raw(trainer_factory):
    t = trainer_factory(callbacks={"checkpoint": ModelCheckpoint(), "ema": EMA(decay=0.5)}, max_epochs=1)
    t.fit()
    saved = torch.load(t.run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["ema"] == {"decay": 0.5, "updates": 4}
    for k, v in t.module.state_dict().items():
        assert torch.equal(saved["raw_model"][k], v), k
    assert not torch.equal(saved["model"]["net.1.weight"], saved["raw_model"]["net.1.weight"])


def test_resume_restores_average(trainer_factory):
    first = trainer_factory("a", callbacks={"checkpoint": ModelCheckpoint(), "ema": EMA(decay=0.5)},
                            max_epochs=1)
    first.fit()
    path = first.run_dir / "checkpoints" / "last.pt"
    saved = torch.load(path, weights_only=True)
    ema = EMA(decay=0.5)
    second = trainer_factory("b", callbacks={"checkpoint": ModelCheckpoint(), "ema": ema}, max_epochs=2)
    from ddpexp.training import checkpoint_state as state

    state.load(second, path)
    assert ema.average.updates == 4
    for k, v in ema.average.averaged().items():
        assert torch.equal(v, saved["model"][k]), k
    for k, v in second.module.state_dict().items():  # the trained weights continue
        assert torch.equal(v, saved["raw_model"][k]), k


# ------------------------------------------------------------------ over training steps
def _train(model: nn.Module, steps: int, ema: WeightAverage | None = None, seed: int = 1) -> None:
    train_steps(model, steps, seed, after_step=None if ema is None else ema.update)


def test_ema_is_the_moving_average_and_copies_buffers():
    model = small_net()
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
    plain, averaged = small_net(), small_net()
    ema = WeightAverage(averaged, decay=0.0)
    _train(plain, 7)
    _train(averaged, 7, ema)
    for name, value in plain.state_dict().items():
        assert torch.equal(ema.averaged()[name], value), name
        assert torch.equal(averaged.state_dict()[name], value), name


def test_ema_applied_swaps_in_and_back_and_loads_into_a_fresh_model():
    model = small_net()
    ema = WeightAverage(model, decay=0.8)
    _train(model, 4, ema)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 4)
    fresh = small_net()
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
    whole = small_net()
    ema_whole = WeightAverage(whole, 0.95)
    _train(whole, 3, ema_whole, seed=1)
    _train(whole, 3, ema_whole, seed=2)

    first = small_net()
    ema_first = WeightAverage(first, 0.95)
    _train(first, 3, ema_first, seed=1)
    saved_model = {k: v.clone() for k, v in first.state_dict().items()}
    saved_ema = {**ema_first.state_dict(),
                 "averaged": {k: v.clone() for k, v in ema_first.state_dict()["averaged"].items()}}
    second = small_net()
    second.load_state_dict(saved_model)
    ema_second = WeightAverage(second, 0.95)
    ema_second.load_state_dict(saved_ema)
    assert ema_second.updates == 3
    _train(second, 3, ema_second, seed=2)
    for name, value in ema_whole.averaged().items():
        assert torch.equal(ema_second.averaged()[name], value), name


@pytest.mark.parametrize("decay", [1.0, -0.1, 1.5])
def test_ema_decay_out_of_range_is_refused(decay):
    with pytest.raises(ConfigError, match=r"trainer.ema_decay=.* must be in \[0, 1\)"):
        EMA(decay=decay)  # the callback, as callbacks.ema and trainer.ema_decay build it
