"""EMA anchor: formula (fp32, bf16), schedule, checkpoints, swapping, TRL convention, FSDP2 shards."""

import os

import pytest
import torch
from torch import nn

from trainer.ema import EMAAnchor, from_trl_mixup_alpha, to_trl_mixup_alpha
from tests.fixtures.spawn import free_port


def _model(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    m.register_buffer("scale", torch.tensor([1.5, 2.5]))
    m.register_buffer("steps", torch.tensor(3))  # integer buffers are not blended
    return m


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
        model.scale.mul_(1.1)


def test_initialised_to_the_policy_and_tracks_buffers():
    m = _model()
    ema = EMAAnchor(m, anchor_decay=0.9)
    assert set(ema.tensors) == {n for n, _ in m.named_parameters()} | {"scale"}
    for n, t in m.state_dict().items():
        if n in ema.tensors:
            assert torch.equal(ema.tensors[n], t)


def test_update_formula_float32_against_float64():
    m = _model()
    theta0 = {n: t.double().clone() for n, t in m.state_dict().items()}
    ema = EMAAnchor(m, anchor_decay=0.9, update_period=1, dtype="float32")
    _perturb(m, 1)
    theta1 = {n: t.double().clone() for n, t in m.state_dict().items()}
    assert ema.maybe_update(1)
    for n, a in ema.tensors.items():
        want = 0.9 * theta0[n] + 0.1 * theta1[n]
        assert a.dtype == torch.float32
        assert torch.allclose(a.double(), want, atol=1e-7), n


def test_update_in_float64_is_exact_in_float64():
    """A float64 anchor blends with η in float64 (it used to be rounded to float32: ~1e-8 relative off)."""
    m = _model().double()
    ema = EMAAnchor(m, anchor_decay=0.9, update_period=1, dtype=torch.float64)
    start = {n: t.clone() for n, t in ema.tensors.items()}
    _perturb(m, 1)
    ema.update()
    sources = {**dict(m.named_parameters()), **dict(m.named_buffers())}
    eta32 = float(torch.tensor(0.9, dtype=torch.float32))
    off32 = 0.0
    for n, a in ema.tensors.items():
        src = sources[n].detach()
        want = start[n] * 0.9 + src * (1.0 - 0.9)
        assert a.dtype == torch.float64
        assert torch.allclose(a, want, atol=0, rtol=4e-16), n  # float64 rounding only
        off32 = max(off32, float((start[n] * eta32 + src * (1.0 - 0.9) - want).abs().max()))
    assert off32 > 1e-9  # what a float32 η gave


def test_mixed_dtypes_blend_each_in_its_own_precision():
    """With ``dtype=None`` each anchor tensor keeps its parameter's dtype; one bucket blends both kinds."""
    m = _model()
    m.register_buffer("precise", torch.tensor([1.0, 3.0], dtype=torch.float64))
    ema = EMAAnchor(m, anchor_decay=0.95, update_period=1, dtype=None)
    start = {n: t.clone() for n, t in ema.tensors.items()}
    with torch.no_grad():
        m.precise.add_(1.0)
        m.scale.add_(1.0)
    ema.update()
    assert ema.tensors["precise"].dtype == torch.float64
    assert torch.equal(ema.tensors["precise"], start["precise"] * 0.95 + m.precise * (1 - 0.95))
    want32 = start["scale"].clone().mul_(torch.tensor(0.95, dtype=torch.float32)).add_(m.scale, alpha=1 - 0.95)
    assert torch.equal(ema.tensors["scale"], want32)


def test_update_in_bfloat16_reproduces_the_papers_arithmetic():
    m = _model()
    ema = EMAAnchor(m, anchor_decay=0.95, update_period=1, dtype=torch.bfloat16)
    start = {n: t.clone() for n, t in ema.tensors.items()}
    _perturb(m, 2)
    ema.update()
    for n, a in ema.tensors.items():
        src = dict(m.named_parameters()).get(n, getattr(m, n, None))
        want = start[n].clone().mul_(0.95).add_(src.detach().to(torch.bfloat16), alpha=0.05)
        assert a.dtype == torch.bfloat16 and torch.equal(a, want), n


def test_bfloat16_anchor_swallows_small_updates_float32_does_not():
    m = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        m.weight.fill_(1.0)
    bf, fp = EMAAnchor(m, anchor_decay=0.95, dtype="bf16"), EMAAnchor(m, anchor_decay=0.95)
    with torch.no_grad():
        m.weight.fill_(1.01)
    bf.update()
    fp.update()
    assert bf.tensors["weight"].item() == 1.0  # 1 + 5e-4 rounds back to 1 in bf16
    assert fp.tensors["weight"].item() == pytest.approx(1.0005, abs=1e-7)


def test_decay_one_is_a_no_op_and_zero_copies():
    m = _model()
    keep, copy = EMAAnchor(m, anchor_decay=1.0, update_period=1), EMAAnchor(m, anchor_decay=0.0, update_period=1)
    before = {n: t.clone() for n, t in keep.tensors.items()}
    _perturb(m, 3)
    keep.maybe_update(1)
    copy.maybe_update(1)
    for n in before:
        assert torch.equal(keep.tensors[n], before[n])
        assert torch.equal(copy.tensors[n], m.state_dict()[n])


def test_piecewise_constant_schedule():
    m = _model()
    ema = EMAAnchor(m, anchor_decay=0.9, update_period=10)
    w = dict(m.named_parameters())["0.weight"]
    expected = w.detach().double().clone()
    updated = []
    for step in range(0, 26):  # step 0 (before training) never updates
        if step:
            _perturb(m, 100 + step)  # the actor update of this step
        before = ema.tensors["0.weight"].clone()
        if ema.maybe_update(step):
            updated.append(step)
            expected = 0.9 * expected + 0.1 * w.detach().double()
        else:
            assert torch.equal(ema.tensors["0.weight"], before)
    assert updated == [10, 20]
    assert ema.num_updates == 2 and ema.last_update_step == 20
    assert not ema.maybe_update(20)  # a replayed step does not blend twice
    assert torch.allclose(ema.tensors["0.weight"].double(), expected, atol=1e-6)


def test_checkpoint_round_trip(tmp_path):
    m = _model()
    ema = EMAAnchor(m, anchor_decay=0.9, update_period=2)
    for step in range(1, 5):
        _perturb(m, step)
        ema.maybe_update(step)
    torch.save(ema.state_dict(), tmp_path / "anchor.pt")
    resumed = EMAAnchor(m, anchor_decay=0.9, update_period=2)  # fresh anchor = current policy
    resumed.load_state_dict(torch.load(tmp_path / "anchor.pt", weights_only=True))
    assert resumed.num_updates == 2 and resumed.last_update_step == 4
    for step in range(5, 7):
        _perturb(m, step)
        ema.maybe_update(step)
        resumed.maybe_update(step)
    for n in ema.tensors:
        assert torch.equal(ema.tensors[n], resumed.tensors[n])
    bad = ema.state_dict()
    bad["tensors"].pop("scale")
    with pytest.raises(ValueError, match="mismatch"):
        resumed.load_state_dict(bad)
    with pytest.raises(ValueError, match="different"):
        EMAAnchor(m, anchor_decay=0.5, update_period=2).load_state_dict(ema.state_dict(), strict_schedule=True)


def test_swap_into_evaluates_the_anchor_and_restores_the_policy():
    m = _model()
    ema = EMAAnchor(m, anchor_decay=0.5, update_period=1)
    _perturb(m, 7)
    ema.update()
    x = torch.randn(4, 6)
    policy_out = m(x)
    policy_state = {n: t.clone() for n, t in m.state_dict().items()}
    reference = _model()
    with torch.no_grad():
        for n, t in reference.named_parameters():
            t.copy_(ema.tensors[n])
    with ema.swap_into(backup_device="cpu") as anchor_model:
        assert torch.allclose(anchor_model(x), reference(x))
    for n, t in m.state_dict().items():
        assert torch.equal(t, policy_state[n])
    assert torch.equal(m(x), policy_out)
    with pytest.raises(RuntimeError):
        with ema.swap_into():
            raise RuntimeError("boom")
    assert all(torch.equal(t, policy_state[n]) for n, t in m.state_dict().items())
    full = ema.full_state_dict()
    assert set(full) == set(ema.tensors) and full["0.weight"].dtype == torch.float32
    assert ema.full_state_dict(torch.bfloat16)["0.weight"].dtype == torch.bfloat16
    other = EMAAnchor(_model(), anchor_decay=0.5)
    other.load_full_state_dict(full, num_updates=1)
    assert all(torch.equal(other.tensors[n], t) for n, t in full.items()) and other.num_updates == 1
    with pytest.raises(ValueError, match="lacks"):
        other.load_full_state_dict({})


def test_trl_mixup_alpha_is_the_complement():
    # TRL: ref ← α·policy + (1−α)·ref; ours: ref ← η·ref + (1−η)·policy.
    assert from_trl_mixup_alpha(0.1) == pytest.approx(0.9)
    assert to_trl_mixup_alpha(0.9) == pytest.approx(0.1)
    m = _model()
    ema = EMAAnchor(m, anchor_decay=from_trl_mixup_alpha(0.1), update_period=1)
    ref0 = {n: t.clone() for n, t in ema.tensors.items()}
    _perturb(m, 9)
    ema.update()
    alpha = 0.1
    for n, p in m.named_parameters():
        trl = alpha * p.detach() + (1 - alpha) * ref0[n]
        assert torch.allclose(ema.tensors[n], trl, atol=1e-7)
    with pytest.raises(ValueError):
        from_trl_mixup_alpha(1.5)


def test_bad_arguments():
    m = _model()
    with pytest.raises(ValueError, match="anchor_decay"):
        EMAAnchor(m, anchor_decay=1.1)
    with pytest.raises(ValueError, match="update_period"):
        EMAAnchor(m, anchor_decay=0.9, update_period=0)
    with pytest.raises(ValueError, match="dtype"):
        EMAAnchor(m, anchor_decay=0.9, dtype="fp8")


# ---------------------------------------------------------------------------------------------
# FSDP2: two gloo processes, shard-local updates, no gather in update().


def _fsdp_worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        full0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        fully_shard(model, mesh=mesh)
        ema = EMAAnchor(model, anchor_decay=0.8, update_period=2, dtype="float32")
        for n, p in model.named_parameters():
            assert isinstance(p, DTensor)
            assert ema.tensors[n].shape == p.to_local().shape  # shard-local storage
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        expected = dict(full0)
        for step in range(1, 5):
            torch.manual_seed(step)
            model(torch.randn(4, 5)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            if ema.maybe_update(step):
                for n, p in model.named_parameters():
                    expected[n] = 0.8 * expected[n] + 0.2 * p.full_tensor().double()
        full = ema.full_state_dict()
        for n, t in full.items():
            assert torch.allclose(t.double(), expected[n], atol=1e-6), n
        # The anchor evaluated through the sharded model equals a plain model with anchor weights.
        plain = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        plain.load_state_dict({n: t.float() for n, t in full.items()})
        x = torch.randn(3, 5)
        policy_plain = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        policy_plain.load_state_dict({n: p.full_tensor() for n, p in model.named_parameters()})
        with torch.no_grad():
            before = model(x)  # a forward without backward leaves the FSDP root unsharded
            with ema.swap_into():
                out = model(x)
            after = model(x)
        assert torch.allclose(before, policy_plain(x), atol=1e-6)
        assert torch.allclose(out, plain(x), atol=1e-6)  # the anchor, not stale unsharded weights
        assert torch.allclose(after, policy_plain(x), atol=1e-6)  # the policy again
        again = EMAAnchor(model, anchor_decay=0.8, update_period=2)
        again.load_full_state_dict(full, num_updates=2, last_update_step=4)
        assert all(torch.equal(again.tensors[n], ema.tensors[n]) for n in ema.tensors)
        state = ema.state_dict()
        restored = EMAAnchor(model, anchor_decay=0.8, update_period=2)
        restored.load_state_dict(state)
        assert all(torch.equal(restored.tensors[n], ema.tensors[n]) for n in ema.tensors)

        # A root wrapper owning some parameters (as the trainer's forward wrapper): the anchor is
        # built on the inner model, and the root must be resharded around swaps too.
        class Wrapper(nn.Module):
            def __init__(self, lm: nn.Module) -> None:
                super().__init__()
                self.lm = lm

            def forward(self, x):
                return self.lm(x)

        torch.manual_seed(1)
        inner = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        root = Wrapper(inner)
        fully_shard(inner[0], mesh=mesh)
        fully_shard(root, mesh=mesh)  # inner[2] belongs to the root unit
        wrapped = EMAAnchor(inner, anchor_decay=0.0, update_period=1, fsdp_root=root)
        with torch.no_grad():
            for p in root.parameters():
                p.to_local().mul_(-1.0)  # the policy moves away from the anchor
        anchor_plain = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        anchor_plain.load_state_dict({n: t.float() for n, t in wrapped.full_state_dict().items()})
        with torch.no_grad():
            root(x)  # leaves the root unit unsharded
            with wrapped.swap_into():
                out = root(x)
        assert torch.allclose(out, anchor_plain(x), atol=1e-6)
        # Both ranks past their last collective before either tears gloo down: a rank that destroys the group
        # while its peer is still in an all-gather can abort the peer ("terminate called without an active
        # exception", SIGABRT), seen once in CI.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_local_shards_two_gloo_processes():
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_worker, args=(2, free_port()), nprocs=2, join=True)
