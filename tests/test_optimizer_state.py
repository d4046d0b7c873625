"""`hetloco.train.optimizer_state`: the inner AdamW's moments in fp32, bf16, 8 bits (torchao) or on
the host. Each option against torch.optim.AdamW on the same parameters and gradients, its bytes per
parameter against `sizes.optimizer_state_bytes_per_param`, its state through a weights-only file, and
the batched simulator against the per-replica one. torchao's tests skip where it is not installed."""
from __future__ import annotations

import sys

import pytest
import torch

from hetloco_ds import optim, safe_load, sizes
from hetloco_ds.config import ConfigError, OptimizerSettings, parse_config

SETTINGS = OptimizerSettings(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LOWBIT = ("bf16", "8bit")


def _torchao():
    return pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao==0.18.0)")


def _case():
    """A quantised-size matrix (64 x 256: 64 blocks of 256), a small vector (kept fp32 by 8bit) and
    two steps of gradients; the second step is the first to read moments back from storage."""
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(64, 256, generator=gen), torch.randn(100, generator=gen)]
    grads = [[torch.randn(b.shape, generator=gen) * scale for b in base] for scale in (1.0, 0.3)]
    return base, grads


def _run(state: str, base, grads, steps: int | None = None):
    params = [torch.nn.Parameter(b.clone()) for b in base]
    opt = optim.build_optimizer(params, SETTINGS, state)
    for g in grads[:steps]:
        for p, gg in zip(params, g):
            p.grad = gg.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return params, opt


def test_the_option_is_checked_at_the_config_edge_in_one_line():
    """A value outside fp32/bf16/8bit/cpu_offload is one ConfigError line naming the key, the value
    and the file; each valid value reaches the typed config. Breaks if a typo trains fp32 silently."""
    for value in sizes.OPTIMIZER_STATES:
        assert parse_config({"hetloco": {"train": {"optimizer_state": value}}}, "x.json").hetloco.train.optimizer_state == value
    assert parse_config({}, "x.json").hetloco.train.optimizer_state == "fp32"
    with pytest.raises(ConfigError) as err:
        parse_config({"hetloco": {"train": {"optimizer_state": "4bit"}}}, "x.json")
    msg = str(err.value)
    assert "\n" not in msg and "x.json" in msg and "hetloco.train.optimizer_state = '4bit'" in msg and "'8bit'" in msg


def test_without_torchao_a_lowbit_option_says_pip_install_torchao(monkeypatch):
    """With torchao not importable, "8bit" and "bf16" are one ConfigError line saying `pip install
    torchao`; "fp32" and "cpu_offload" never import it. Breaks if torchao becomes a hard dependency or
    its absence surfaces as a traceback."""
    optim._lowbit_classes.cache_clear()
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    try:
        for state in LOWBIT:
            with pytest.raises(ConfigError) as err:
                optim.build_optimizer([torch.nn.Parameter(torch.zeros(3))], SETTINGS, state)
            assert "\n" not in str(err.value) and "pip install torchao" in str(err.value) and repr(state) in str(err.value)
        for state in ("fp32", "cpu_offload"):
            optim.build_optimizer([torch.nn.Parameter(torch.zeros(3))], SETTINGS, state)
    finally:
        optim._lowbit_classes.cache_clear()


def test_cpu_offload_on_the_cpu_is_fp32_bit_for_bit():
    """On the CPU, "cpu_offload" copies weights and gradients host to host and steps the same
    non-fused AdamW: two steps give fp32's parameters and moments exactly, and the state dict has
    fp32's layout (so either loads the other's). Breaks if a copy is missed, stale (the device weight
    written outside the optimizer not picked up) or ordered wrong."""
    base, grads = _case()
    ref, ref_opt = _run("fp32", base, grads)
    got, opt = _run("cpu_offload", base, grads)
    assert isinstance(opt, optim.HostAdamW) and isinstance(opt, torch.optim.Optimizer)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["param_groups"] == ref_sd["param_groups"]
    for i in sd["state"]:
        assert all(torch.equal(sd["state"][i][k], ref_sd["state"][i][k]) for k in ref_sd["state"][i])

    # A weight changed outside the optimizer (as the outer step does) is what the next step starts from.
    params = [torch.nn.Parameter(b.clone()) for b in base]
    opt = optim.build_optimizer(params, SETTINGS, "cpu_offload")
    with torch.no_grad():
        params[0].mul_(0.5)
    params[0].grad = grads[0][0].clone()
    opt.step()
    check = torch.nn.Parameter(base[0].clone() * 0.5)
    ref_opt = optim.build_optimizer([check], SETTINGS, "fp32")
    check.grad = grads[0][0].clone()
    ref_opt.step()
    assert torch.equal(params[0], check) and torch.equal(params[1], base[1])


def _reference_ratio(ref_opt, i: int, step: int) -> torch.Tensor:
    """|m^ / sqrt(v^)| of torch's AdamW after `step` steps: the size of parameter i's update in lr's."""
    st = ref_opt.state_dict()["state"][i]
    b1, b2 = SETTINGS.betas
    return (st["exp_avg"] / (1 - b1 ** step)).abs() / ((st["exp_avg_sq"] / (1 - b2 ** step)).sqrt() + SETTINGS.eps)


def _one_and_two_steps(state: str):
    """(the weights before, fp32's and `state`'s optimizer after one step, then fp32's and `state`'s
    (weights, optimizer) after two) on `_case`'s tensors; skips without torchao."""
    _torchao()
    base, grads = _case()
    _, one_ref = _run("fp32", base, grads, steps=1)
    _, one = _run(state, base, grads, steps=1)
    return base, one_ref, one, _run("fp32", base, grads), _run(state, base, grads)


def test_bf16_moments_move_the_weights_as_fp32_adamw_within_their_rounding():
    """"bf16" against torch.optim.AdamW on the same weights and gradients. After one step the stored
    moments are torch's rounded to bf16 (8 significant bits: relative error <= 2^-8, round to nearest). The second step
    reads them back: its moments m2 = b1 m1 + ..., v2 = b2 v1 + ... in fp32 carry m1's and v1's
    rounding, em = 2^-8 b1 |m1| and ev = 2^-8 b2 v1, so each weight's update lr m^/sqrt(v^) differs
    from torch's by at most lr / bc1 (em + |m2| ev / (2 v2)) / sqrt(v2 / bc2) to first order;
    asserted with a factor 2 for the second order, plus 4 ulps of the weight for the fp32 arithmetic
    done in another order. Breaks if the moments are not bf16 (the weights would equal torch's) or
    the step is another rule (the difference would exceed the bound)."""
    base, one_ref, one, (ref, ref_opt), (got, _) = _one_and_two_steps("bf16")
    b1, b2 = SETTINGS.betas
    for i, (a, b, start) in enumerate(zip(got, ref, base)):
        st1, ref1 = one.state_dict()["state"][i], one_ref.state_dict()["state"][i]
        for k in ("exp_avg", "exp_avg_sq"):
            assert st1[k].dtype == torch.bfloat16
            assert ((st1[k].float() - ref1[k]).abs() <= 2 ** -8 * ref1[k].abs() * (1 + 1e-5) + 1e-30).all(), k
        ref2 = ref_opt.state_dict()["state"][i]
        em, ev = 2 ** -8 * b1 * ref1["exp_avg"].abs(), 2 ** -8 * b2 * ref1["exp_avg_sq"]
        m2, v2 = ref2["exp_avg"], ref2["exp_avg_sq"]
        first_order = SETTINGS.lr / (1 - b1 ** 2) * (em + m2.abs() * ev / (2 * v2)) / (v2 / (1 - b2 ** 2)).sqrt()
        bound = 2 * first_order + 4 * torch.finfo(torch.float32).eps * start.abs().clamp(min=1e-3)
        diff = (a - b).detach().abs()
        assert (diff <= bound).all(), (diff / bound).max()
    assert not torch.equal(got[0], ref[0])


def test_8bit_moments_are_within_one_code_step_and_the_update_within_a_tenth_of_lr_on_average():
    """"8bit" against torch.optim.AdamW. After one step the 64 x 256 matrix's moments are 8-bit codes
    with one scale per 256 values: dequantised, each is torch's moment within half the widest gap
    of torchao's code map times its block's scale (the quantisation bound, taken from the map
    itself). The weights' second update (two steps) then carries that error through m^/sqrt(v^): measured
    0.13 lr at most and 0.008 lr on average on this case, asserted <= 0.25 lr and <= 0.02 lr (an
    element far below its block's largest value keeps fewer significant bits). The 100-value vector
    is under torchao's 4096 and keeps fp32 moments: torch's within fp32 rounding. Breaks if the
    moments are not quantised, or quantised more coarsely than the map allows."""
    base, one_ref, one, (ref, _), (got, opt) = _one_and_two_steps("8bit")
    sd, ref_sd = one.state_dict(), one_ref.state_dict()
    for k in ("exp_avg", "exp_avg_sq"):
        enc = sd["state"][0][k]
        assert set(enc) == {"codes", "scale", "qmap", "signed"} and enc["codes"].dtype == torch.uint8
        deq = enc["qmap"][enc["codes"].long()].view(-1, 256) * enc["scale"].view(-1, 1)
        half_gap = enc["qmap"].sort().values.diff().max() / 2
        err = (deq - ref_sd["state"][0][k].view(-1, 256)).abs()
        assert (err <= half_gap * enc["scale"].view(-1, 1) * (1 + 1e-5) + 1e-12).all(), k
        assert sd["state"][1][k].dtype == torch.float32
    diff = (got[0] - ref[0]).detach().abs() / SETTINGS.lr
    assert 0 < diff.mean() <= 0.02 and diff.max() <= 0.25, (diff.mean(), diff.max())
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-6)


def _state_bytes(opt) -> int:
    """Bytes of the tensors a live optimizer's state holds (torchao's 8-bit moments: codes, scales, map)."""
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if not torch.is_tensor(v) or v.dim() == 0:
                continue  # the step counter
            parts = [v.codes, v.scale, v.qmap] if hasattr(v, "codes") else [v]
            total += sum(t.numel() * t.element_size() for t in parts)
    return total


@pytest.mark.parametrize("state", sizes.OPTIMIZER_STATES)
def test_the_state_takes_the_bytes_per_parameter_the_option_promises(state):
    """After one step on a 512 x 1024 matrix, the optimizer's state tensors take
    `sizes.optimizer_state_bytes_per_param(state)` per parameter exactly ("8bit": 2 + 8/256, plus its
    two 256-entry fp32 code maps, 2 KiB); "cpu_offload" keeps its 8 on the host with the host copies
    of the weight and gradient (16 there, 0 on the device, which on the CPU is the host too). Breaks
    if the size rule `plan` will read disagrees with what the optimizer allocates."""
    if state in LOWBIT:
        _torchao()
    p = torch.nn.Parameter(torch.randn(512, 1024))
    opt = optim.build_optimizer([p], SETTINGS, state)
    p.grad = torch.randn_like(p)
    opt.step()
    n = p.numel()
    if state == "cpu_offload":
        host = _state_bytes(opt) + sum(t.numel() * t.element_size() for t in opt.host + opt.host_grads)
        assert host == sizes.optimizer_state_bytes_per_param(state, "host") * n
        assert sizes.optimizer_state_bytes_per_param(state) == 0
    else:
        maps = 2 * 256 * 4 if state == "8bit" else 0
        assert _state_bytes(opt) == sizes.optimizer_state_bytes_per_param(state) * n + maps
        assert sizes.optimizer_state_bytes_per_param(state, "host") == 0
    assert sizes.optimizer_state_bytes_per_param("8bit") == pytest.approx(2.03125)
    with pytest.raises(ValueError):
        sizes.optimizer_state_bytes_per_param("4bit")


@pytest.mark.parametrize("state", sizes.OPTIMIZER_STATES)
def test_the_state_dict_is_plain_data_and_resumes_bitwise_through_a_weights_only_file(state, tmp_path):
    """One step, the state dict written with torch.save and read back by safe_load (weights_only),
    loaded into a fresh optimizer over the same weights: plain data (`safe_load.plain_data_problem`),
    the LR a float in param_groups, and the next step bit for bit the uninterrupted optimizer's,
    weights and moments (bf16 moments stay bf16, 8-bit ones 8-bit). Breaks if a tensor subclass
    reaches the file (the checkpoint could not be read back) or a moment changes type on load."""
    if state in LOWBIT:
        _torchao()
    base, grads = _case()
    params, opt = _run(state, base, grads, steps=1)
    sd = opt.state_dict()
    assert safe_load.plain_data_problem(sd) is None
    assert all(type(g["lr"]) is float for g in opt.param_groups)
    torch.save(sd, tmp_path / "opt.pt")
    loaded = safe_load.load(tmp_path / "opt.pt", mmap=False)

    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = optim.build_optimizer(resumed, SETTINGS, state)
    opt2.load_state_dict(loaded)
    for ps, o in ((params, opt), (resumed, opt2)):
        for p, g in zip(ps, grads[1]):
            p.grad = g.clone()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(params, resumed))
    a, b = opt.state_dict()["state"], opt2.state_dict()["state"]
    for i in a:
        for k, v in a[i].items():
            w = b[i][k]
            if isinstance(v, dict):
                assert all(torch.equal(v[f], w[f]) for f in ("codes", "scale", "qmap")) and v["signed"] == w["signed"]
            else:
                assert v.dtype == w.dtype and torch.equal(v, w), (i, k)
