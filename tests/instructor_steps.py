"""Instructor against the server at argv[1] (its /v1 URL) serving model argv[2]; run in .venv-frameworks
by tests/test_instructor.py, which reads the JSON it prints."""
import json
import sys

import instructor
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, field_validator

url, model = sys.argv[1], sys.argv[2]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
attempts = []


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")  # (so the schema, and the grammar, allows no other fields)
    city: str


class RefusedOnce(Weather):
    @field_validator("city")
    @classmethod
    def refused_once(cls, city: str) -> str:
        attempts.append(city)
        if len(attempts) == 1:  # the first answer fails validation: Instructor asks again
            raise ValueError("name the city in capital letters")
        return city


openai = OpenAI(base_url=url, api_key="unused", max_retries=0)
usages = []
tools = instructor.from_openai(openai, mode=instructor.Mode.TOOLS)
tools.on("completion:response", lambda response: usages.append(response.usage.model_dump()))
weather = tools.chat.completions.create(model=model, response_model=RefusedOnce, messages=QUESTION, max_retries=2,
                                        temperature=0, max_tokens=40)
schema = instructor.from_openai(openai, mode=instructor.Mode.JSON_SCHEMA)
answer, completion = schema.chat.completions.create_with_completion(
    model=model, response_model=Weather, messages=QUESTION, max_retries=0, temperature=0, max_tokens=40)
print(json.dumps({"tools": {"city": weather.city, "attempts": attempts, "usages": usages},
                  "json_schema": {"city": answer.city, "finish_reason": completion.choices[0].finish_reason}}))
