// A stand-in for an agent in Node.js: it charges a card every second until it
// is told no. Node's built-in fetch ignores the proxy variables (before the
// versions that read NODE_USE_ENV_PROXY), so it would go around a proxy
// unseen: `stopgate exec` runs it in a sandbox whose every TCP connection
// goes through stopgate's guard. It stops on the SIGTERM exec sends at the
// cancel too.
//
//     node agent.js UPSTREAM_URL [MAX_REQUESTS]     (default 120)
const upstream = (process.argv[2] || "").replace(/\/$/, "");
const limit = Number(process.argv[3] || 120);
process.on("SIGTERM", () => {
  console.log("node agent: SIGTERM (the run was cancelled), stopping");
  process.exit(0);
});

async function main() {
  for (let n = 1; n <= limit; n++) {
    const resp = await fetch(upstream + "/charge", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ agent: "node", charge: n }),
    });
    const text = await resp.text();
    if (!resp.ok) {
      console.log(`node agent: charge ${n}: ${resp.status} ${resp.headers.get("x-stopgate-refusal") || ""}: ${text}`);
      console.log("node agent: refused, stopping");
      return 0;
    }
    console.log(`node agent: charge ${n}: ${resp.status}`);
    await new Promise((r) => setTimeout(r, 1000));
  }
  console.log(`node agent: ${limit} charges and never refused`);
  return 1;
}

main().then((code) => process.exit(code), (err) => { console.log(`node agent: ${err}`); process.exit(2); });
