// The official Stripe Node library (npm `stripe`) against idemgate on routes
// with `errors = "stripe"`: its 400, 409 and 422 must reach the caller as
// the library's errors with the right statusCode, type and code (with
// problem+json alone, stripe-node resolves them as results), and its retry
// loop must follow Stripe-Should-Retry. Run by scripts/sdk_stripe.sh, which
// passes the proxy's port and the fake upstream's hit counter URL.
import Stripe from "stripe";
import assert from "node:assert/strict";

const [port, hitsUrl] = process.argv.slice(2);
const client = (retries) =>
  new Stripe("sk_test_idemgate", {
    host: "127.0.0.1",
    port: Number(port),
    protocol: "http",
    maxNetworkRetries: retries,
  });
const hits = async () => Number(await (await fetch(hitsUrl)).text());
const raises = async (promise, check) => {
  try {
    const result = await promise;
    assert.fail(`resolved as a result: ${JSON.stringify(result)}`);
  } catch (e) {
    if (e instanceof assert.AssertionError) throw e;
    check(e);
  }
};

// 400: a key longer than 255 characters, and a route whose key header the
// library does not send.
await raises(
  client(2).rawRequest("POST", "/v1/customers", { name: "a" }, { idempotencyKey: "k".repeat(300) }),
  (e) => {
    assert.equal(e.type, "StripeInvalidRequestError", e.message);
    assert.equal(e.statusCode, 400);
    assert.equal(e.raw.type, "invalid_request_error");
  },
);
await raises(client(2).rawRequest("POST", "/v1/charges", { amount: "1" }), (e) => {
  assert.equal(e.type, "StripeInvalidRequestError", e.message);
  assert.equal(e.statusCode, 400);
  assert.equal(e.code, "parameter_missing");
});

// 422: the same key with other parameters; not retried (Stripe-Should-Retry: false).
const first = await client(2).rawRequest("POST", "/v1/customers", { name: "a" }, { idempotencyKey: "sdk-k1" });
assert.equal(first.id, "cus_1");
const before = await hits();
await raises(
  client(2).rawRequest("POST", "/v1/customers", { name: "b" }, { idempotencyKey: "sdk-k1" }),
  (e) => {
    assert.equal(e.type, "StripeAPIError", e.message);
    assert.equal(e.statusCode, 422);
    assert.equal(e.raw.type, "idempotency_error");
  },
);
const replay = await client(2).rawRequest("POST", "/v1/customers", { name: "a" }, { idempotencyKey: "sdk-k1" });
assert.equal(replay.id, "cus_1", "the replay is the stored answer");
assert.equal(await hits(), before, "neither the 422 nor the replay reached the upstream");

// 409: the first request is still running after the library's retries.
const slow = client(0).rawRequest("POST", "/v1/customers?slow=4", { name: "c" }, { idempotencyKey: "sdk-k2" });
await new Promise((r) => setTimeout(r, 300));
const started = Date.now();
await raises(
  client(1).rawRequest("POST", "/v1/customers?slow=4", { name: "c" }, { idempotencyKey: "sdk-k2" }),
  (e) => {
    assert.equal(e.type, "StripeAPIError", e.message);
    assert.equal(e.statusCode, 409);
    assert.equal(e.code, "idempotency_key_in_use");
  },
);
assert.ok(Date.now() - started >= 400, "the library retried the 409 once before raising");
assert.equal((await slow).id, "cus_2");
// Once the first has answered, the library's retry gets its answer.
const settled = await client(1).rawRequest("POST", "/v1/customers?slow=4", { name: "c" }, { idempotencyKey: "sdk-k2" });
assert.equal(settled.id, "cus_2");
assert.equal(await hits(), before + 1, "the 409'd duplicate never executed");
console.log("stripe-node: 400, 409 and 422 raised with their status, type and code; retries followed Stripe-Should-Retry");
