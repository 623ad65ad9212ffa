// The official openai SDK (built on fetch) against an OpenAI-compatible
// server: one completion, or a streamed one that prints each chunk as it
// comes and how the stream ended.
import OpenAI from "openai";

const [baseURL, mode] = process.argv.slice(2);
const client = new OpenAI({ baseURL: baseURL + "/v1", apiKey: "sk-test", maxRetries: 0, timeout: 60_000 });
const started = Date.now();
try {
  if (mode === "stream") {
    const stream = await client.chat.completions.create({ model: "m", messages: [{ role: "user", content: "count" }], stream: true });
    let n = 0;
    for await (const chunk of stream) {
      n++;
      console.log(`chunk ${n} ${chunk.choices[0]?.delta?.content ?? ""} at ${Date.now()}`);
    }
    console.log(`openai-stream ended cleanly after ${n} chunks at ${Date.now()}`);
  } else {
    const c = await client.chat.completions.create({ model: "m", messages: [{ role: "user", content: "hi" }] });
    console.log(`openai 200 ${c.choices[0].message.content}`);
  }
} catch (e) {
  console.log(`openai${mode === "stream" ? "-stream" : ""} error ${e.status ?? e.cause?.code ?? e.name} after ${Date.now() - started}ms at ${Date.now()}`);
}
