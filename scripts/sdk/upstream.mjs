// A fake Stripe-like API for scripts/sdk_stripe.sh: POST creates cus_N
// (after ?slow=SECONDS), GET /hits says how many POSTs executed.
import http from "node:http";
let created = 0;
http
  .createServer((req, res) => {
    const url = new URL(req.url, "http://x");
    if (req.method === "GET" && url.pathname === "/hits") {
      res.end(String(created));
      return;
    }
    if (req.method !== "POST") {
      res.writeHead(404).end();
      return;
    }
    req.resume();
    req.on("end", () => {
      setTimeout(() => {
        created += 1;
        res.writeHead(200, { "content-type": "application/json" });
        res.end(JSON.stringify({ id: `cus_${created}`, object: "customer" }));
      }, 1000 * Number(url.searchParams.get("slow") || 0));
    });
  })
  .listen(Number(process.argv[2]), "127.0.0.1");
