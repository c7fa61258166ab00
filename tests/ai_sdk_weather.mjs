// What the AI SDK scripts share: the SDK loaded from AI_SDK_DIR, and the weather step's settings (the model
// must call get_weather on the first step, which the SDK executes, and may not call it on the second, so a
// run is two model calls whatever a small model would choose).
import { createRequire } from 'node:module';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const require = createRequire(join(process.env.AI_SDK_DIR, 'package.json'));
export const load = (name) => import(pathToFileURL(require.resolve(name)).href);
const { tool, jsonSchema, isStepCount } = await load('ai');

export const weatherSettings = (model) => ({
  model,
  temperature: 0,
  maxOutputTokens: 40,
  tools: {
    get_weather: tool({
      description: 'Get the current weather in a city',
      inputSchema: jsonSchema({ type: 'object', properties: { city: { type: 'string' } }, required: ['city'] }),
      execute: async ({ city }) => ({ city, temperature: 21, sky: 'clear' }),
    }),
  },
  prepareStep: ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? 'required' : 'none' }),
  stopWhen: isStepCount(2),
});
