//! The Lua scripts: each touches one key (so Redis Cluster needs no hash
//! tags) and reads the value layout of [`super::value`] at fixed offsets.

use redis::Script;

pub(super) struct Scripts {
    /// `SET NX PX` our lock, or read what is there and its PTTL: one round
    /// trip for a fresh key and for a duplicate alike.
    pub(super) lock_or_peek: Script,
    /// Deletes the key only if it holds the caller's lock.
    pub(super) unlock: Script,
    /// Re-arms the caller's lock with a new PX.
    pub(super) extend: Script,
    /// Replaces the caller's lock with the completed value, carrying the
    /// lock's `created_at`, fingerprint and first use over (a completion
    /// carries none of them). Without our lock there it deletes whatever is there (older
    /// than this completion): the next claim reads the record from the
    /// inner store and caches it then.
    pub(super) complete: Script,
    /// Puts a record's copy in only while the name still holds the value
    /// the claim saw there before it asked the inner store (our lock, or
    /// the copy it could not use): an operator's delete, resolve or
    /// rewrite that `DEL`s the name in between wins, and the record just
    /// read (which PostgreSQL may no longer hold) is not cached.
    pub(super) cache: Script,
}

impl Scripts {
    pub(super) fn new() -> Self {
        Self {
            lock_or_peek: Script::new(LOCK_OR_PEEK_LUA),
            unlock: Script::new(UNLOCK_LUA),
            extend: Script::new(EXTEND_LUA),
            complete: Script::new(COMPLETE_LUA),
            cache: Script::new(CACHE_LUA),
        }
    }
}

// Lua strings are 1-based: the token is bytes 50..65 of a lock.
/// `1` when our lock went in; else `{value or ""}` (no encoded value
/// is empty, so `""` means the key expired in between: impossible inside
/// one script, kept for clarity).
const LOCK_OR_PEEK_LUA: &str = r#"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
return {redis.call('GET', KEYS[1]) or ''}
"#;

const UNLOCK_LUA: &str = r#"
local v = redis.call('GET', KEYS[1])
if v and string.byte(v, 1) == 1 and string.sub(v, 50, 65) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"#;

const EXTEND_LUA: &str = r#"
local v = redis.call('GET', KEYS[1])
if v and string.byte(v, 1) == 1 and string.sub(v, 50, 65) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"#;

// ARGV: token, the completed value without a first use (its created_at,
// expires_at and fingerprint are placeholders), now, keep_ms, the tag
// for the value with one, and the longest PX a copy gets (MAX_COPY_MS). The lock's own expires_at (the claim's, in the
// claiming process's clock, which is this one) gives the expiry: max(claim's
// expiry, now + keep), written into the value and turned into a relative
// PX, so no clock but the holder's is consulted. The lock's first use
// (bytes 66 on, if any) goes right after the head, under that tag.
const COMPLETE_LUA: &str = r#"
local v = redis.call('GET', KEYS[1])
if v and string.byte(v, 1) == 1 and string.sub(v, 50, 65) == ARGV[1] then
  local exp = 0
  for i = 10, 17 do exp = exp * 256 + string.byte(v, i) end
  local now = tonumber(ARGV[3])
  exp = math.max(exp, now + tonumber(ARGV[4]))
  local bytes, n = {}, exp
  for i = 8, 1, -1 do bytes[i] = string.char(n % 256); n = math.floor(n / 256) end
  local tag, first = string.sub(ARGV[2], 1, 1), string.sub(v, 66)
  if first ~= '' then tag = ARGV[5] end
  local val = tag .. string.sub(v, 2, 9) .. table.concat(bytes)
    .. string.sub(v, 18, 49) .. first .. string.sub(ARGV[2], 50)
  redis.call('SET', KEYS[1], val, 'PX', math.min(exp - now, tonumber(ARGV[6])))
  return 1
end
-- Not our lock: whatever is there is older than this completion.
redis.call('DEL', KEYS[1])
return 0
"#;

// ARGV: the value expected there, the copy, its PX. `1` when it went in.
const CACHE_LUA: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"#;

/// What [`RedisFastPath::lock_or_peek`] found.
pub(super) enum Locking {
    /// Our lock went in.
    Locked,
    /// Something was there: its value (`None` if it expired in between).
    /// A lock's PTTL is not read: another claimant's lock is confirmed with
    /// the inner store, whose record says how long it is held.
    Held(Option<Vec<u8>>),
}
