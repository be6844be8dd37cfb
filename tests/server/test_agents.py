"""openai-agents (the OpenAI Agents SDK) runs a one-tool agent against the server unchanged:
the served model name is accepted as it is, the Responses API's objects pass the SDK's parsing,
and the tool call the first turn is made to produce is run and answered in a second turn."""

from __future__ import annotations

import asyncio
import json

import pytest

from .conftest import ServerProc

agents = pytest.importorskip("agents")


def test_one_tool_agent_runs(server: ServerProc, model: str) -> None:
    from openai import AsyncOpenAI

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny, 21 C"

    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none")
    agent = agents.Agent(
        name="weather", instructions="Answer with the weather.", tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=model, openai_client=client),
        # a random-weight model calls no tool of its own accord: the first turn must, and
        # the SDK resets the choice after a tool call, so the second turn answers in text
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                            max_tokens=40))
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=4,
                                           run_config=agents.RunConfig(tracing_disabled=True)))
    assert len(calls) == 1 and isinstance(calls[0], str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item", kinds
    assert isinstance(result.final_output, str)
    output = next(i for i in result.new_items if i.type == "tool_call_output_item")
    assert json.dumps(output.output) and "sunny" in str(output.output)
