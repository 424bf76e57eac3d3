import os

import json

from loadtest.chaos.soak import Sample, growth, read_proc, reanalyse


def test_growth_is_measured_after_the_warm_up_against_the_mean_of_the_last_samples():
    samples = [Sample(0.0, 50 * 2**20, 10),      # start-up: not the baseline
               Sample(60.0, 100 * 2**20, 20),    # the baseline
               Sample(120.0, 100 * 2**20, 20),
               Sample(180.0, 103 * 2**20, 21), Sample(240.0, 104 * 2**20, 21), Sample(300.0, 105 * 2**20, 22)]
    g = growth(samples, warm_s=60.0)
    assert g["num_samples"] == 5
    assert g["rss_start_mib"] == 100.0 and g["rss_end_mib"] == 104.0
    assert g["rss_growth"] == 0.04
    assert (g["fd_start"], g["fd_end"], g["fd_growth"]) == (20, 22, 2)
    # the middle of 60..300 s is 180 s: 103 MiB, so the second half grew 104 / 103 - 1
    assert g["rss_middle_mib"] == 103.0 and g["rss_growth_second_half"] == round(104 / 103 - 1, 4)


def test_a_plateau_shows_growth_in_the_first_half_only_and_a_leak_in_both():
    plateau = [Sample(60.0 * i, (100 + min(i, 3) * 10) * 2**20, 10) for i in range(1, 12)]
    leak = [Sample(60.0 * i, (100 + i * 10) * 2**20, 10) for i in range(1, 12)]
    p, k = growth(plateau, warm_s=60.0), growth(leak, warm_s=60.0)
    assert p["rss_growth"] > 0.15 and p["rss_growth_second_half"] == 0.0
    assert k["rss_growth"] > 0.15 and k["rss_growth_second_half"] > 0.2


def test_too_few_samples_after_the_warm_up_give_no_figure():
    assert growth([Sample(0.0, 1, 1), Sample(10.0, 2, 1)], warm_s=5.0)["rss_growth"] is None


def test_read_proc_reads_this_process_and_nothing_for_a_gone_one():
    rss, fds = read_proc(os.getpid())
    assert rss > 10 * 2**20 and fds >= 3
    assert read_proc(2**22 + 12345) is None


def test_reanalyse_recomputes_the_figures_of_a_saved_run(tmp_path):
    samples = {"nats-server": [{"at_s": 60.0 * i, "rss_bytes": (20 + min(i, 4)) * 2**20, "num_fds": 9}
                               for i in range(12)]}
    path = tmp_path / "soak.json"
    path.write_text(json.dumps({"processes": {}, "worst_rss_growth": None, "samples": samples}))
    result = reanalyse(path, warm_s=120.0)
    g = result["processes"]["nats-server"]
    assert g["rss_start_mib"] == 22.0 and g["rss_end_mib"] == 24.0 and g["rss_growth_second_half"] == 0.0
    assert result["worst_rss_growth"] == round(24 / 22 - 1, 4)
