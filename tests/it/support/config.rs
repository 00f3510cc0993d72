//! [`TestConfig`]: the config file a test wants, built as a `toml::Table`
//! and rendered with `toml::to_string`. Every suite writes its config
//! through it: the in-process proxy parses the rendered text, the
//! child-process harness writes it to a file.
//!
//! Keys are set by dotted path (`server.upstream_timeout`), so a test's
//! value replaces a default one instead of adding a second line.

use idemgate::config::Config;
use std::net::SocketAddr;
use std::path::Path;
use toml::{Table, Value};

/// A config under construction.
#[derive(Clone, Debug, Default)]
pub struct TestConfig {
    table: Table,
}

impl TestConfig {
    /// Only `[server] upstream = "http://{upstream}"`.
    pub fn new(upstream: SocketAddr) -> Self {
        Self::default().set("server.upstream", format!("http://{upstream}"))
    }

    /// Sets `dotted` (`section.key`) to `value`, replacing any earlier value
    /// and creating the section when it is missing.
    pub fn set(mut self, dotted: &str, value: impl Into<Value>) -> Self {
        let (sections, key) = dotted.rsplit_once('.').unwrap_or(("", dotted));
        let mut table = &mut self.table;
        for name in sections.split('.').filter(|s| !s.is_empty()) {
            table = table
                .entry(name)
                .or_insert_with(|| Value::Table(Table::new()))
                .as_table_mut()
                .unwrap_or_else(|| panic!("{dotted}: `{name}` is not a table"));
        }
        table.insert(key.to_string(), value.into());
        self
    }

    /// Appends a `[[route]]`.
    pub fn route(mut self, route: Route) -> Self {
        self.table
            .entry("route")
            .or_insert_with(|| Value::Array(Vec::new()))
            .as_array_mut()
            .expect("`route` is an array of tables")
            .push(Value::Table(route.0));
        self
    }

    /// Sets `key` on every route added so far.
    pub fn each_route(mut self, key: &str, value: impl Into<Value>) -> Self {
        let value = value.into();
        let routes = self.table.get_mut("route").and_then(Value::as_array_mut);
        for route in routes.into_iter().flatten() {
            route
                .as_table_mut()
                .expect("a route is a table")
                .insert(key.to_string(), value.clone());
        }
        self
    }

    /// `server.listen` and `admin.listen` (for a child process).
    pub fn listen(self, listen: SocketAddr, admin: SocketAddr) -> Self {
        self.set("server.listen", listen.to_string())
            .set("admin.listen", admin.to_string())
    }

    /// The TOML text.
    pub fn render(&self) -> String {
        toml::to_string(&self.table).expect("a TOML table renders")
    }

    /// Writes the TOML text to `path`.
    pub fn write(&self, path: &Path) {
        std::fs::write(path, self.render())
            .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }

    /// The typed config, as `idemgate` would load it from a file.
    pub fn parse(&self) -> Config {
        let text = self.render();
        Config::parse(&text, "test.toml")
            .unwrap_or_else(|e| panic!("test config does not parse: {e}\n{text}"))
    }
}

/// One `[[route]]` table.
#[derive(Clone, Debug)]
pub struct Route(Table);

impl Route {
    /// `methods = ["POST"]` on `path`.
    pub fn post(path: &str) -> Self {
        Self(Table::new())
            .set("methods", vec!["POST"])
            .set("path", path)
    }

    pub fn set(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.0.insert(key.to_string(), value.into());
        self
    }
}
