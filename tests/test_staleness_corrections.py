"""The gradient-side staleness corrections against plain references: numpy arrays through
NumpyOps and torch tensors (the same code the adapters call), and torch.optim.AdamW's own step."""
import numpy as np
import pytest
import torch

from pipesgd_hvd.ops.numpy import NumpyOps
from pipesgd_hvd.staleness.formulas import adam_direction, delay_compensated, eager_mix

RNG = np.random.default_rng(0)
G, W1, W0 = (RNG.standard_normal(50).astype(np.float32) for _ in range(3))


def test_delay_compensation_matches_taylor_reference():
    want = G + 0.3 * G * G * (W1 - W0)
    np.testing.assert_allclose(delay_compensated(NumpyOps(), G, W1, W0, 0.3), want, rtol=1e-6)
    got = delay_compensated(None, *(torch.from_numpy(a) for a in (G, W1, W0)), 0.3)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)  # float32 rounding order only


def test_delay_compensation_rejects_bad_lambda():
    with pytest.raises(ValueError, match="dc_lambda"):
        delay_compensated(NumpyOps(), G, W1, W0, -1.0)


def test_eager_mix_replaces_own_share_of_the_average():
    others = RNG.standard_normal(50).astype(np.float32)
    avg_stale = (G + others) / 2  # rank's stale G, other rank's stale gradient
    want = (W1 + others) / 2      # W1 stands for this rank's fresh gradient
    np.testing.assert_allclose(eager_mix(avg_stale, W1, G, 2), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="world_size"):
        eager_mix(avg_stale, W1, G, 0)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adam_direction_is_adamws_next_step(weight_decay):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(20))
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    for _ in range(3):
        p.grad = torch.randn(20)
        opt.step()
    st = opt.state[p]
    p.grad = torch.zeros(20)  # the next step's moments then only decay; predict from them
    m, v, step = st["exp_avg"] * 0.9, st["exp_avg_sq"] * 0.99, int(st["step"]) + 1
    direction = adam_direction(None, m, v, step, 1e-2, 0.9, 0.99, 1e-8, p.detach().clone(), weight_decay)
    before = p.detach().clone()
    opt.step()
    # AdamW decays w before the Adam step (lr*wd*w*(lr*...) second order): 1e-6 covers it and float32.
    torch.testing.assert_close(before - direction, p.detach(), rtol=0, atol=1e-6)
