// An agent's tool loop on the Vercel AI SDK (npm `ai` and `@ai-sdk/openai-compatible`, from AI_SDK_DIR)
// against the OpenAI-compatible server at BASE_URL: the model must call get_weather on the first step
// (which the SDK executes) and may not call it on the second, so the run is two model calls whatever a
// small model would choose. MODE "generate" runs generateText, "stream" streamText. Prints the steps as
// one JSON line. Run by tests/test_ai_sdk.py.
import { load, weatherSettings } from './ai_sdk_weather.mjs';

const { generateText, streamText } = await load('ai');
const { createOpenAICompatible } = await load('@ai-sdk/openai-compatible');

const provider = createOpenAICompatible({ name: 'infercept', baseURL: process.env.BASE_URL, apiKey: 'unused',
                                          includeUsage: true });
const settings = { ...weatherSettings(provider.chatModel(process.env.MODEL)), prompt: 'What is the weather in Paris?' };

let steps;
if (process.env.MODE === 'stream') {
  const result = streamText(settings);
  await result.consumeStream();
  steps = await result.steps;
} else {
  steps = (await generateText(settings)).steps;
}
console.log(JSON.stringify(steps.map((s) => ({
  finishReason: s.finishReason, text: s.text, usage: s.usage,
  toolCalls: s.toolCalls.map((c) => ({ name: c.toolName, input: c.input })),
  toolResults: s.toolResults.map((r) => r.output),
}))));
