//! The conventional `process_*` metrics (CPU seconds, resident and virtual
//! memory, open and maximum file descriptors, start time), read from
//! `/proc/self` at each scrape. prometheus-client has no process collector;
//! this is the small Linux one. Elsewhere it reports nothing.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// `USER_HZ`, the unit of `/proc/<pid>/stat` times: 100 on every Linux
/// architecture Rust targets (the kernel exports it as such to userspace).
const USER_HZ: f64 = 100.0;

#[derive(Debug)]
pub(super) struct ProcessCollector;

/// What one scrape read; absent values are left out of the exposition.
#[derive(Debug, Default, PartialEq)]
struct Sample {
    cpu_seconds: Option<f64>,
    resident_bytes: Option<f64>,
    virtual_bytes: Option<f64>,
    open_fds: Option<f64>,
    max_fds: Option<f64>,
    start_time_seconds: Option<f64>,
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = read();
        if let Some(v) = s.cpu_seconds {
            let c = ConstCounter::new(v);
            let m = encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds",
                None,
                c.metric_type(),
            )?;
            c.encode(m)?;
        }
        for (name, help, value) in [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                s.resident_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                s.virtual_bytes,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                s.open_fds,
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                s.max_fds,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since the unix epoch in seconds",
                s.start_time_seconds,
            ),
        ] {
            if let Some(v) = value {
                let g = ConstGauge::new(v);
                let m = encoder.encode_descriptor(name, help, None, g.metric_type())?;
                g.encode(m)?;
            }
        }
        Ok(())
    }
}

fn read() -> Sample {
    let file = |p: &str| std::fs::read_to_string(p).ok();
    let mut s = Sample::default();
    if let Some(stat) = file("/proc/self/stat") {
        let boot = file("/proc/stat").and_then(|t| boot_time(&t));
        s = from_stat(&stat, boot);
    }
    s.resident_bytes = file("/proc/self/status").and_then(|t| vm_rss_bytes(&t));
    s.open_fds = std::fs::read_dir("/proc/self/fd")
        .ok()
        .map(|d| d.count() as f64);
    s.max_fds = file("/proc/self/limits").and_then(|t| max_open_files(&t));
    s
}

/// CPU, virtual memory and start time from `/proc/self/stat`; `boot` is
/// the boot time in unix seconds (`btime` of `/proc/stat`).
fn from_stat(stat: &str, boot: Option<f64>) -> Sample {
    // The command name (field 2) may hold spaces and parentheses: the
    // fields to read come after its last ')'. Field 3 is index 0 here.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return Sample::default();
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let num = |field: usize| fields.get(field - 3).and_then(|v| v.parse::<f64>().ok());
    let cpu = num(14).zip(num(15)).map(|(u, s)| (u + s) / USER_HZ);
    Sample {
        cpu_seconds: cpu,
        virtual_bytes: num(23),
        start_time_seconds: boot.zip(num(22)).map(|(b, ticks)| b + ticks / USER_HZ),
        ..Sample::default()
    }
}

fn boot_time(proc_stat: &str) -> Option<f64> {
    proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

fn vm_rss_bytes(status: &str) -> Option<f64> {
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024.0)
}

fn max_open_files(limits: &str) -> Option<f64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    // "Max open files            1024                 1048576              files"
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_proc_files() {
        let stat = "4242 (idem gate) (x)) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 50 0 0 20 0 9 0 12345 987654321 2048 18446744073709551615";
        let s = from_stat(stat, Some(1_700_000_000.0));
        assert_eq!(s.cpu_seconds, Some(3.0));
        assert_eq!(s.virtual_bytes, Some(987_654_321.0));
        assert_eq!(s.start_time_seconds, Some(1_700_000_123.45));
        assert_eq!(from_stat("garbage", None), Sample::default());
        assert_eq!(
            boot_time("cpu  1 2 3\nbtime 1700000000\n"),
            Some(1_700_000_000.0)
        );
        assert_eq!(
            vm_rss_bytes("Name:\tidemgate\nVmRSS:\t   2048 kB\n"),
            Some(2_097_152.0)
        );
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1024                 1048576              files\n";
        assert_eq!(max_open_files(limits), Some(1024.0));
    }

    /// On Linux, this process's own numbers are all there.
    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_has_every_sample() {
        let s = read();
        assert!(s.cpu_seconds.is_some() && s.resident_bytes.unwrap() > 0.0);
        assert!(s.open_fds.unwrap() >= 1.0 && s.max_fds.is_some());
        assert!(s.start_time_seconds.unwrap() > 1_600_000_000.0);
    }
}
