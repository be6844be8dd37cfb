"""`Request.tokens(start, end)`: the step's input positions read in place equal slicing the
whole prompt + output + drafts list, for every cut."""

from __future__ import annotations

from kdaserve.request import Request, SamplingParams


def test_tokens_equal_slices_of_the_whole_list() -> None:
    req = Request("r", [1, 2, 3, 4], SamplingParams())
    for output, drafts in (([], []), ([5, 6], []), ([5, 6, 7], [8, 9])):
        req.output_ids, req.draft_ids = list(output), list(drafts)
        whole = req.all_ids + req.draft_ids
        for start in range(len(whole) + 1):
            for end in range(start, len(whole) + 2):
                assert req.tokens(start, end) == whole[start:end], (output, drafts, start, end)
