import json

import pytest

from dilated.bench.planner.calibration import Calibration, Curve, log_interp
from synthetic_calibration import calibration, link


def test_curve_is_exact_on_an_affine_link_between_and_beyond_its_points():
    c = link(latency=0.05, per_ms=1e8)
    for moved in (3e5, 5e6, 7.7e8, 4e9):  # between points and past the largest
        assert c.time_ms(moved) == pytest.approx(0.05 + moved / 1e8, rel=1e-9)
    assert c.time_ms(0) == 0.0
    assert c.bandwidth_gbs == pytest.approx(100.0, rel=1e-6)


def test_curve_below_its_smallest_point_is_that_point():
    c = Curve([1e6, 1e7], [0.3, 0.4])
    assert c.time_ms(10.0) == 0.3


def test_log_interp_is_linear_in_the_logarithm_and_flat_outside():
    assert log_interp(4.0, [1.0, 16.0], [0.0, 4.0]) == pytest.approx(2.0)
    assert log_interp(0.5, [1.0, 16.0], [0.0, 4.0]) == 0.0
    assert log_interp(99.0, [1.0, 16.0], [0.0, 4.0]) == 4.0


def test_a_calibration_reads_back_as_written(tmp_path):
    import dataclasses

    from dilated.bench.planner.calibration import StrategyPoint

    timed = StrategyPoint("documents", 4, "fwd", 65536, 32, 8, 128, True, "lognormal:8k,1.0", 7.5)
    cal = calibration(command="test", varlen_kernel=None, strategies=[timed])
    cal.kernels[0] = dataclasses.replace(cal.kernels[0], slowest_ms=cal.kernels[0].ms * 1.1)
    path = tmp_path / "cal.json"
    cal.save(str(path))
    back = Calibration.load(str(path))
    assert back == cal
    # one written before slowest ranks and strategy calls were timed reads as one without them
    data = json.loads(path.read_text())
    del data["strategies"]
    for k in data["kernels"]:
        del k["slowest_ms"]
    path.write_text(json.dumps(data))
    old = Calibration.load(str(path))
    assert old.strategies == [] and old.slowest_rank_pace() == 1.0


@pytest.mark.parametrize("content, words", [
    (None, "cannot read"),
    ("{not json", "cannot read"),
    (json.dumps({"format": 99}), "format"),
    (json.dumps({"format": 1, "device": "x"}), "malformed"),
])
def test_a_bad_calibration_file_names_itself_and_the_fix(tmp_path, content, words):
    path = tmp_path / "cal.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=words) as e:
        Calibration.load(str(path))
    assert str(path) in str(e.value) and "calibrat" in str(e.value)


def test_a_calibration_without_kernel_times_is_refused(tmp_path):
    cal = calibration()
    cal.kernels = []
    cal.save(str(tmp_path / "c.json"))
    with pytest.raises(ValueError, match="no kernel times"):
        Calibration.load(str(tmp_path / "c.json"))
