"""What a vLLM request asks of fxreplace and what a scheduler step starts and ends, read from
vLLM's own objects for vLLM's runner and vllm-neuron's (both run under vLLM's scheduler).

Per request, ``SamplingParams(extra_args={"fxreplace": "off"})`` (online:
``"vllm_xargs": {"fxreplace": "off"}``) serves a request without replacement even
when its prompt is in the reference; ``{"fxreplace": {"captures": [names]}}`` replaces only
those captures (an engine configured with ``select_captures``; the front end checks it).
"""

from __future__ import annotations

from ..protocol import NewRequest, StepRequests

OFF_VALUES = ("off", "false", "0", False, 0)
NOTHING = StepRequests()  # most steps (a steady decode) end and start no request: nothing to build


def switched_off(sampling_params) -> bool:
    """Whether a request's ``extra_args["fxreplace"]`` turns replacement off."""
    extra = getattr(sampling_params, "extra_args", None)
    return bool(extra) and extra.get("fxreplace") in OFF_VALUES


def selection_of(sampling_params):
    """A request's ``extra_args["fxreplace"]`` when it is a selection (a dict), else None."""
    extra = getattr(sampling_params, "extra_args", None)
    value = extra.get("fxreplace") if extra else None
    return value if isinstance(value, dict) else None


def step_requests(scheduler_output) -> StepRequests:
    """The requests vLLM's scheduler output ends (``finished_req_ids``) and starts
    (``scheduled_new_reqs``), each new one with what it asks of fxreplace."""
    finished, scheduled = scheduler_output.finished_req_ids, scheduler_output.scheduled_new_reqs
    if not finished and not scheduled:
        return NOTHING
    new = []
    for request in scheduled:
        params = request.sampling_params
        selection = selection_of(params)
        replace = False if switched_off(params) else True if selection is None else list(selection["captures"])
        new.append(NewRequest(request.req_id, request.prompt_token_ids, replace))
    return StepRequests(finished, new)
