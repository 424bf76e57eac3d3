"""Reading the hypervisor's share of CPU time from /proc/stat (``loadtest/tools/cpu_steal.py``)."""

from loadtest.tools.cpu_steal import busy_share, cpu_times, steal_share


def test_the_steal_share_is_the_stolen_ticks_over_all_ticks_between_two_readings(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 50 0 25 400 5 0 0 20 0 0\nintr 1\n")
    before = cpu_times(stat)
    assert before == {"user": 100, "nice": 0, "system": 50, "idle": 800, "iowait": 10, "irq": 0, "softirq": 0,
                      "steal": 40}
    stat.write_text("cpu  160 0 60 820 10 0 0 100 0 0\n")
    assert steal_share(before, cpu_times(stat)) == 60 / 150
    assert steal_share(before, before) is None                   # no time passed
    assert cpu_times(tmp_path / "missing") is None and steal_share(None, before) is None



def test_the_busy_share_is_everything_but_idle_and_iowait(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 0 40 0 0\n")
    before = cpu_times(stat)
    stat.write_text("cpu  130 5 60 880 20 0 5 40 0 0\n")  # 50 busy ticks (user, nice, system, softirq) of 140
    assert busy_share(before, cpu_times(stat)) == 50 / 140
    assert busy_share(before, before) is None and busy_share(None, before) is None
