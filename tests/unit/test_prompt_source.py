from miles_lite.data import ArithmeticSpec, generate_problems
from miles_lite.data.source import PromptSource


def _source(seed=0):
    return PromptSource(generate_problems(10, ArithmeticSpec(seed=3)), seed=seed)


def test_epochs_cover_every_problem_in_new_orders():
    src = _source()
    first = [i for i, _ in src.next_batch(10)]
    second = [i for i, _ in src.next_batch(10)]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second and src.epoch == 1


def test_state_dict_resumes_the_same_order():
    a, b = _source(), _source()
    a.next_batch(7)
    b.load_state_dict(a.state_dict())
    assert [i for i, _ in a.next_batch(9)] == [i for i, _ in b.next_batch(9)]


def test_keep_only_restricts_the_stream():
    src = _source()
    src.next_batch(3)
    src.keep_only([1, 2, 5])
    seen = {i for i, _ in src.next_batch(12)}
    assert seen == {1, 2, 5}
