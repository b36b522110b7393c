"""The `lorafleet` CLI's argument checks (no services needed): numbers that the unsigned proto
fields cannot hold, and malformed token ids, are usage errors (exit 2 with the flag named), not
tracebacks; a prompt and --prompt-ids together are one too; and the worker refuses NaN and
infinite sampling values as the router does."""
from __future__ import annotations

import math

import pytest

from services.client.cli import _parser
from services.common.errors import InvalidArgument
from services.common.gen.lorafleet.v1 import common_pb2


@pytest.mark.parametrize("flags,named", [
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--top-k", "-3"], "--top-k"),
    (["--seed", "-1"], "--seed"),
    (["--max-new-tokens", str(1 << 32)], "--max-new-tokens"),
    (["--prompt-ids=-5,2"], "--prompt-ids"),
    (["--prompt-ids", "1,x"], "--prompt-ids"),
])
def test_out_of_range_numbers_are_usage_errors(flags, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["generate", *flags, "hi"])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_prompt_ids_and_counts_parse():
    a = _parser().parse_args(["generate", "--prompt-ids", "1, 2,3", "--seed", str((1 << 64) - 1),
                              "--max-new-tokens", "7"])
    assert a.prompt_ids == [1, 2, 3] and a.seed == (1 << 64) - 1 and a.max_new_tokens == 7


def test_a_prompt_and_prompt_ids_together_are_a_usage_error(capsys):
    """The operator contract reads `[--prompt-ids 1,2,3 | PROMPT]`: one or the other (the ids
    used to win silently). Checked before any connection is made."""
    from services.client.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(["--router", "127.0.0.1:1", "generate", "--prompt-ids", "1,2", "hello"])
    assert exit_info.value.code == 2
    assert "not both" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_worker_refuses_non_finite_sampling(field, value):
    from services.worker.api.servicer import sampling_from
    with pytest.raises(InvalidArgument, match="sampling"):
        sampling_from(common_pb2.SamplingParams(**{field: value}))
    sampling_from(common_pb2.SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1))
