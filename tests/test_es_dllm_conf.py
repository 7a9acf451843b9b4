"""``es-dllm-conf`` (ES-dLLM with alpha = 1): the kept positions follow the official rule at alpha = 1 and
differ from ``es-dllm``'s. Forced refresh == ``none``, batch == alone and a row joining mid-block come from
the suite's per-policy tests, through the settings the class inherits (``forced_refresh``, ``test_params``)."""

from __future__ import annotations

from test_es_dllm import BUF, check_against_reference, lm8, spied_run  # noqa: F401  (lm8: the fixture)

from ecache_cli.cache import make_policy


def test_registered_as_es_dllm_with_alpha_1():
    pol = make_policy("es-dllm-conf")
    assert pol.params() == {**make_policy("es-dllm").params(), "alpha": 1.0}


def test_kept_positions_equal_the_reference_at_alpha_1(lm8):  # noqa: F811
    checked, skipped = check_against_reference(lm8, make_policy("es-dllm-conf", block_update_freq=BUF), 1.0)
    assert skipped == 3 * 28 and checked == 2 * skipped


def test_confidence_alone_keeps_other_positions_than_the_mix(lm8):  # noqa: F811
    def kept(name):
        steps, _, _ = spied_run(lm8, make_policy(name, block_update_freq=BUF))
        return [s["keep"] for st in steps for s in st["shrinks"]]

    mix, conf = kept("es-dllm"), kept("es-dllm-conf")
    assert len(mix) == len(conf) > 0
    assert any(a.shape != b.shape or not bool((a == b).all()) for a, b in zip(mix, conf))
