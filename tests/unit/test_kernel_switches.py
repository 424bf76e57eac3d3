"""Every CPU kernel's off switch is a field of ``kernels.cache_dir.KernelSwitches`` (the one place its
``TANDEM_`` variable is defined), and setting it to off is what ``why_not`` reads."""

import pytest

from kernels import attention_cpu, blocks_cpu, fused_cpu, int8_cpu, prefill_attention
from kernels.cache_dir import KernelSwitches
from kernels.cpu_build import why_not

SWITCHES = [*(m._KERNEL._args[4] for m in (attention_cpu, blocks_cpu, fused_cpu, int8_cpu, prefill_attention)),
            "TANDEM_BLOCK_PANELS"]


@pytest.mark.parametrize("switch", SWITCHES)
def test_each_switch_is_a_setting_and_off_turns_its_kernel_away(switch, monkeypatch):
    field = switch.removeprefix("TANDEM_").lower()
    assert field in KernelSwitches.model_fields, switch
    monkeypatch.setenv(switch, "off")
    assert why_not(switch, ()) == f"{switch}=off"
    monkeypatch.setenv(switch, "on")
    assert why_not(switch, ()) is None


def test_the_switches_are_all_used():
    assert {f"TANDEM_{name.upper()}" for name in KernelSwitches.model_fields} == set(SWITCHES)
