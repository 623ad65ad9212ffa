// Node's global fetch, which reads no proxy variable (Node 20 and 22).
const [url] = process.argv.slice(2);
try {
  const r = await fetch(url, { method: "POST", body: "{}" });
  console.log(`fetch ${r.status} ${r.headers.get("x-stopgate-refusal") ?? ""}`.trim());
} catch (e) {
  console.log(`fetch error ${e.cause?.code ?? e.message}`);
}
