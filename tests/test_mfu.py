"""MFU: FLOPs per step (formula and FlopCounterMode), the peak table, and the ratio by scope."""

from __future__ import annotations

import pytest

from resilient.core.errors import ConfigError
from resilient.metrics.ledger import Ledger, LedgerConfig
from resilient.metrics.mfu import account_mfu, lookup_device, mfu, normalise_dtype, resolve_peak, transformer_flops


def test_six_n_t_with_and_without_the_attention_term():
    assert transformer_flops(124_000_000, 8 * 1024) == 6 * 124_000_000 * 8 * 1024
    n, t, layers, seq, d = 124_000_000, 8 * 1024, 12, 1024, 768
    assert transformer_flops(n, t, n_layers=layers, seq_len=seq, d_model=d) == 6 * n * t + 12 * layers * seq * d * t
    with pytest.raises(ConfigError, match="all three or none"):
        transformer_flops(n, t, n_layers=layers)
    with pytest.raises(ConfigError, match="must be > 0"):
        transformer_flops(0, t)


def test_flop_counter_on_a_linear_layer():
    import torch  # a core dependency; imported here so the other tests stay light

    from resilient.metrics.mfu import count_flops

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64)
    forward = 2 * 64 * 64 * 8
    # Forward, plus the weight gradient; no input gradient since x does not require one: 2x, not 3x.
    assert count_flops(model, x) == 2 * forward
    assert count_flops(model, x.requires_grad_(True)) == 3 * forward == 196_608
    assert all(p.grad is None for p in model.parameters())  # gradients left as they were
    assert count_flops(model, (x,), loss_fn=lambda out: (out ** 2).mean()) == 3 * forward
    with pytest.raises(ConfigError, match="requires grad"):
        count_flops(model, x, loss_fn=lambda out: out.detach().sum())


@pytest.mark.parametrize(("name", "entry", "bf16_tflops"), [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5),
    ("NVIDIA H200", "H200 SXM", 989.4),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5),
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0),
    ("NVIDIA A100-SXM4-40GB", "A100", 312.0),
    ("NVIDIA A100 80GB PCIe", "A100", 312.0),
    ("NVIDIA L40S", "L40S", 362.05),
    ("NVIDIA L4", "L4", 121.0),
    ("NVIDIA A10G", "A10", 125.0),
    ("NVIDIA A10", "A10", 125.0),
    ("NVIDIA B200", "B200", 2250.0),
    ("Tesla V100-SXM2-16GB", "V100 SXM2", None),
])
def test_peak_table_by_nvml_name(name, entry, bf16_tflops):
    found = lookup_device(name)
    assert found is not None and found.name == entry
    peak = resolve_peak(name, "bf16")
    if bf16_tflops is None:
        assert peak.flops is None and "no bf16" in peak.reason
    else:
        assert peak.flops == pytest.approx(bf16_tflops * 1e12) and peak.source == f"table: {entry} bf16"


def test_dtype_selection():
    assert resolve_peak("NVIDIA H100 80GB HBM3", "torch.float32").flops == pytest.approx(66.9e12)
    assert resolve_peak("NVIDIA H100 80GB HBM3", "float32", allow_tf32=True).flops == pytest.approx(494.7e12)
    assert resolve_peak("NVIDIA A100-SXM4-80GB", "fp16").flops == pytest.approx(312e12)
    assert resolve_peak("Tesla V100-SXM2-16GB", "half").flops == pytest.approx(125e12)
    assert normalise_dtype("bfloat16") == "bf16"
    with pytest.raises(ConfigError, match="fp8"):
        normalise_dtype("fp8")


def test_cpu_has_no_peak_unless_configured():
    peak = resolve_peak(None)
    assert peak.flops is None and peak.source is None and "--peak-tflops" in peak.reason
    assert mfu(1e12, 10, 5.0, peak.flops) is None
    unknown = resolve_peak("Some Future GPU")
    assert unknown.flops is None and "not in the peak table" in unknown.reason
    configured = resolve_peak(None, peak_tflops=0.5)
    assert configured.flops == pytest.approx(0.5e12) and configured.source == "configured peak"
    assert mfu(1e11, 10, 4.0, configured.flops) == 0.5  # 1e12 FLOPs in 4 s of a 0.5e12 FLOP/s device
    with pytest.raises(ConfigError, match="peak_tflops"):
        resolve_peak(None, peak_tflops=0)


def test_mfu_needs_time():
    assert mfu(1e12, 10, 0.0, 1e12) is None
    assert mfu(None, 10, 1.0, 1e12) is None


def test_mfu_of_an_account_by_scope_counts_new_steps_over_their_time():
    """Run and window MFU from one ledger account: replayed steps and their seconds never count."""
    flops, peak = 1e9, 1e9  # per step (whole job), per device; two devices
    ledger = Ledger(LedgerConfig(ideal_step_s=1.0, window_s=20.0))
    ledger.agent_started(0.0)
    ledger.generation_started(0.0, 1, 2, 2, restart=False)
    ledger.section(0.0, 0, "init", 0)
    for s in range(30):  # 10 s of init, then one step a second; step s completes at 11 + s
        ledger.section(10.0 + s, 0, "step", s)
    a = ledger.account(40.0)
    assert a.window.new_steps == 20.0 and a.window.seconds["productive"] == 20.0  # steps 9..28, in [20, 40]
    assert account_mfu(a, flops, peak) == {"run": 29 * flops / (30.0 * 2 * peak), "window": 0.5}

    ledger.failure(40.0, 39.5, "i1", "exit")
    ledger.generation_ended(41.0, "failed")
    ledger.generation_started(45.0, 2, 2, 2, restart=True)
    for i, s in enumerate(range(20, 35)):  # steps 20..28 again (replays), then new steps 29..33 complete
        ledger.section(46.0 + i, 0, "step", s)
    a = ledger.account(60.0)
    assert (a.attempted_steps, a.replayed_steps) == (43, 9)
    assert a.window.new_steps == 5.0
    assert {k: v for k, v in a.window.seconds.items() if v} == {"productive": 5.0, "recovery": 6.0, "replay": 9.0}
    # Run: 34 new steps over 29.5 + 5 productive seconds (the last 0.5 s before the failure became detection).
    assert account_mfu(a, flops, peak) == {"run": 34 * flops / (34.5 * 2 * peak), "window": 0.5}
    assert account_mfu(a, None, peak) == {"run": None, "window": None}
    assert account_mfu(a, flops, None) == {"run": None, "window": None}
