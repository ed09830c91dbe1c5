"""Labels, seeds, option order and the numbers over a question's labels."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st

from gmlx.errors import ValidationError
from gmlx.decisions import stats
from gmlx.decisions.labels import check_label_tokens, labels_for
from gmlx.decisions.orders import option_order
from gmlx.decisions.seeds import derive_seed, sample_seed, thought_seed
from gmlx.decisions.types import Question


def question(qid="x", qtype="choice", n=3):
    options = ("yes", "no") if qtype == "noul" else tuple(f"o{i}" for i in range(n))
    return Question(qid, qtype, "", options, (None,) * len(options), labels_for(qtype, len(options)))


def test_labels_for():
    assert labels_for("noul", 2) == ("yes", "no")
    assert labels_for("choice", 3) == ("A", "B", "C")
    assert labels_for("score", 3) == ("1", "2", "3")
    assert labels_for("score", 9)[-1] == "9"
    assert labels_for("score", 10) == tuple("ABCDEFGHIJ")


def test_label_not_one_token_names_question_and_label():
    qs = [question("team", n=3)]
    with pytest.raises(ValidationError) as caught:
        check_label_tokens(qs, lambda label: None if label == "B" else ord(label))
    assert "'team'" in caught.value.message and "'B'" in caught.value.message
    assert caught.value.param == "questions.team"


def test_labels_sharing_a_token_rejected():
    with pytest.raises(ValidationError) as caught:
        check_label_tokens([question("urgent", "noul")], lambda label: 7)
    assert "'urgent'" in caught.value.message and "'yes'" in caught.value.message and "'no'" in caught.value.message


def test_labels_of_different_questions_may_share_tokens():
    check_label_tokens([question("a"), question("b")], ord)  # no exception; same tokens across questions
    seen = []
    check_label_tokens([question("a", n=2)], lambda label: seen.append(label) or len(seen))
    assert seen == ["A", "B"]


def test_seeds_are_31_bit_and_distinct():
    seeds = {sample_seed(42, s, c, k) for s in range(3) for c in range(3) for k in range(4)}
    assert len(seeds) == 36
    assert all(0 <= x < 2**31 for x in seeds)
    # Fixed by (seed, place) across processes and machines: blake2b, not Python's hash().
    assert sample_seed(42, 0, 0, 0) == derive_seed(42, "read", 0, 0, 0) == 1199989883
    assert sample_seed(42, 0, 0, 0) != sample_seed(43, 0, 0, 0)
    assert thought_seed(42) == derive_seed(42, "think") != sample_seed(42, 0, 0, 0)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_choice_orders_are_balanced_rotations(n):
    x = question("team", n=n)
    for seed in (1, 123, 99999):
        orders = [option_order(x, k, seed) for k in range(n)]
        assert orders[0] == list(range(n))
        rotations = [[(i + o[0]) % n for i in range(n)] for o in orders]
        assert orders == rotations  # each a cyclic rotation of the request order
        # k = n samples: every option at every position exactly once.
        for position in range(n):
            assert sorted(o[position] for o in orders) == list(range(n))
        # Then the reversed request order's rotations, then the cycle repeats.
        period = 2 * n if n >= 3 else 2
        rev = [option_order(x, k, seed) for k in range(n, period)]
        if n >= 3:
            assert rev[0] == list(range(n))[::-1]
            assert all(o == rev[0][rev[0].index(o[0]):] + rev[0][:rev[0].index(o[0])] for o in rev)
            # 2n samples: the set of listings is the same for the reversed request.
            both = {tuple(o) for o in orders + rev}
            assert len(both) == 2 * n
            flipped = {tuple(n - 1 - i for i in o) for o in both}  # the reversed request's listings, as original indices
            assert {tuple(o) for o in both} == {tuple(o) for o in flipped}
        assert [option_order(x, k, seed) for k in range(period, period + n)] == orders
    starts = {option_order(x, 1, seed)[0] for seed in range(50)}
    assert len(starts) == n - 1 if n > 2 else starts == {1}


def test_noul_and_score_alternate():
    assert [option_order(question("u", "noul"), k, 7) for k in range(4)] == [[0, 1], [1, 0], [0, 1], [1, 0]]
    s = question("s", "score", 4)
    assert [option_order(s, k, 7) for k in range(3)] == [[0, 1, 2, 3], [3, 2, 1, 0], [0, 1, 2, 3]]


def test_listed_question_keeps_labels_with_their_meaning():
    from gmlx.decisions.orders import by_option, listed

    s = question("s", "score", 3)
    rev = listed(s, [2, 1, 0])
    assert rev.options == tuple(reversed(s.options)) and rev.labels == ("3", "2", "1")  # level keeps its label
    c = question("team", n=3)
    rot = listed(c, [1, 2, 0])
    assert rot.options == (c.options[1], c.options[2], c.options[0]) and rot.labels == c.labels  # letters by position
    u = listed(question("u", "noul"), [1, 0])
    assert u.labels == ("no", "yes") and u.options == ("no", "yes")
    assert by_option([0.7, 0.2, 0.1], [1, 2, 0]) == [0.1, 0.7, 0.2]


def test_label_probs_and_mass():
    lps = [math.log(0.6), math.log(0.2)]
    assert stats.label_probs(lps) == pytest.approx([0.75, 0.25], abs=1e-15)
    assert stats.label_mass(lps) == pytest.approx(0.8, abs=1e-15)
    assert stats.label_probs([-math.inf, 0.0]) == [0.0, 1.0]


def test_entropy():
    assert stats.entropy([0.5, 0.5]) == pytest.approx(math.log(2))
    assert stats.entropy([1.0, 0.0]) == 0.0


def test_argmax_ties_go_to_first():
    assert stats.argmax([0.4, 0.4, 0.2]) == 0
    assert stats.argmax([0.1, 0.5, 0.4]) == 1


def test_stderr():
    assert stats.stderr([0.9, 0.3]) == pytest.approx(0.3)
    assert stats.stderr([0.5]) == 0.0


def test_confidence_probability_mode():
    assert stats.confidence("choice", [0.8, 0.2]) == 0.8
    assert stats.confidence("score", [0.1, 0.3, 0.6]) == 0.6
    assert stats.confidence("noul", [0.3, 0.7]) == 0.7


def test_confidence_typesafe_known_vectors():
    assert stats.confidence("choice", [0.8, 0.2], "typesafe") == pytest.approx(0.6)
    # mode 2, E|i-2| = 0.5, mean |i-1| over {0,1,2} = 2/3 -> 1 - 0.75
    assert stats.confidence("score", [0.1, 0.3, 0.6], "typesafe") == pytest.approx(0.25)
    assert stats.confidence("score", [1 / 3, 1 / 3, 1 / 3], "typesafe") == 0.0  # clipped at 0 (1 - 1/(2/3) < 0)
    assert stats.confidence("score", [0.0, 1.0, 0.0], "typesafe") == 1.0
    assert stats.confidence("choice", [0.25] * 4, "typesafe") == pytest.approx(0.0)
    # A noul keeps max(P(yes), P(no)).
    assert stats.confidence("noul", [0.3, 0.7], "typesafe") == 0.7


def test_expected_index():
    assert stats.expected_index([0.1, 0.3, 0.6]) == pytest.approx(1.5)


logprob = st.floats(min_value=-60.0, max_value=0.0, allow_nan=False)


@given(st.integers(2, 26).flatmap(lambda n: st.lists(st.lists(logprob, min_size=n, max_size=n), min_size=1, max_size=8)))
def test_averaged_probabilities_sum_to_one(samples):
    avg = stats.average([stats.label_probs(lps) for lps in samples])
    assert abs(math.fsum(avg) - 1.0) < 1e-9
    assert sum(avg) == pytest.approx(1.0, abs=1e-9)
    assert all(0.0 <= p <= 1.0 for p in avg)
