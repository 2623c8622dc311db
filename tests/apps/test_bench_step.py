"""`lioncub bench step`: both ways of getting the gradients run every method and move the same bytes."""

from lioncub.apps.benchmarks.step import bench_step


def test_gradients_through_backward_and_by_hand_send_the_same_bytes():
    methods = ["vote-1bit", "l1-pbit"]
    runs = [bench_step(2, 200_000, 1, 1, methods, public=False, backward=b) for b in (False, True)]
    assert [r["gradients"] for r in runs] == ["set by hand", "through autograd, overlap=False"]
    rows = [{r["method"]: r for r in res["rows"]} for res in runs]
    for by_hand, backward in zip(rows[0].values(), rows[1].values()):
        assert by_hand["method"] == backward["method"] and backward["ms"] > 0
        assert by_hand["bytes_sent"] == backward["bytes_sent"]
    assert set(rows[1]) == {"local", *methods} and rows[1]["l1-pbit"]["bytes_sent"] > 0
