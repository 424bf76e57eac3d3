import os

from loadtest.soak import Sample, growth, read_proc


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


def test_too_few_samples_after_the_warm_up_give_no_figure():
    assert growth([Sample(0.0, 1, 1), Sample(10.0, 2, 1)], warm_s=5.0)["rss_growth"] is None


def test_read_proc_reads_this_process_and_nothing_for_a_gone_one():
    rss, fds = read_proc(os.getpid())
    assert rss > 10 * 2**20 and fds >= 3
    assert read_proc(2**22 + 12345) is None
