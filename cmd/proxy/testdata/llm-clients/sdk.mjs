// Calls an OpenAI- or Anthropic-shaped API with its official SDK through
// stopgate's egress proxy, as an agent would, and prints what the SDK
// raised as one JSON line: what an agent's log shows of a refusal.
//
//   node sdk.mjs openai|anthropic BASE_URL PROXY_HOST:PORT RUN
//
// Node's fetch ignores proxy variables, so the SDK is given a fetch that
// sends absolute-URI requests to the proxy with the run as credentials.
import http from "node:http";
import OpenAI from "openai";
import Anthropic from "@anthropic-ai/sdk";

const [sdk, baseURL, proxy, run] = process.argv.slice(2);
const [proxyHost, proxyPort] = proxy.split(":");

async function proxiedFetch(input, init = {}) {
  const url = new URL(typeof input === "string" || input instanceof URL ? input : input.url);
  const headers = Object.fromEntries(new Headers(init.headers ?? {}).entries());
  headers["proxy-authorization"] = "Basic " + Buffer.from(`${run}:1`).toString("base64");
  headers.host = url.host;
  const body = init.body == null ? undefined : typeof init.body === "string" ? init.body : Buffer.from(await new Response(init.body).arrayBuffer());
  return new Promise((resolve, reject) => {
    const req = http.request({ host: proxyHost, port: Number(proxyPort), method: init.method ?? "GET", path: url.href, headers }, (res) => {
      const chunks = [];
      res.on("data", (c) => chunks.push(c));
      res.on("end", () => {
        const h = new Headers();
        for (const [k, v] of Object.entries(res.headers)) h.set(k, Array.isArray(v) ? v.join(", ") : v);
        resolve(new Response(Buffer.concat(chunks), { status: res.statusCode, headers: h }));
      });
      res.on("error", reject);
    });
    req.on("error", reject);
    if (body !== undefined) req.write(body);
    req.end();
  });
}

let attempts = 0;
const counting = (input, init) => { attempts++; return proxiedFetch(input, init); };
try {
  if (sdk === "openai") {
    const client = new OpenAI({ apiKey: "sk-test", baseURL, fetch: counting });
    await client.chat.completions.create({ model: "gpt-test", messages: [{ role: "user", content: "hello" }] });
  } else {
    const client = new Anthropic({ apiKey: "sk-ant-test", baseURL, fetch: counting });
    await client.messages.create({ model: "claude-test", max_tokens: 16, messages: [{ role: "user", content: "hello" }] });
  }
  console.log(JSON.stringify({ ok: true, attempts }));
} catch (err) {
  console.log(JSON.stringify({
    ok: false, attempts, name: err.constructor.name, status: err.status, message: err.message,
    code: err.code ?? null, type: err.type ?? null, refusal: err.headers?.get?.("x-stopgate-refusal") ?? null,
  }));
}
