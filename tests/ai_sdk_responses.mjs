// A two-turn chat with a tool on the Vercel AI SDK's OpenAI provider (npm `ai` and `@ai-sdk/openai`, from
// AI_SDK_DIR), on its Responses model (the provider's default), against the server at BASE_URL: each turn's
// first step must call get_weather (which the SDK executes) and its second may not; the second turn sends
// the first turn's messages back, which the provider sends as `item_reference`s to the stored output it
// came from (`store` is its default). Prints the turns' steps and the request bodies as one JSON line. Run
// by tests/test_ai_sdk.py.
import { load, weatherSettings } from './ai_sdk_weather.mjs';

const { generateText } = await load('ai');
const { createOpenAI } = await load('@ai-sdk/openai');

const bodies = [];
const provider = createOpenAI({
  baseURL: process.env.BASE_URL, apiKey: 'unused',
  fetch: async (url, init) => { bodies.push(JSON.parse(init.body)); return fetch(url, init); },
});
const settings = weatherSettings(provider.responses(process.env.MODEL));

const steps = (result) => result.steps.map((s) => ({
  finishReason: s.finishReason, text: s.text, usage: s.usage,
  toolCalls: s.toolCalls.map((c) => ({ name: c.toolName, input: c.input })),
}));
const question = { role: 'user', content: 'What is the weather in Paris?' };
const first = await generateText({ ...settings, messages: [question] });
const second = await generateText({ ...settings, messages: [question, ...first.response.messages,
                                                            { role: 'user', content: 'And in Rome?' }] });
console.log(JSON.stringify({ turns: [steps(first), steps(second)], bodies }));
