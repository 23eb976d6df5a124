//! Metric families registered when a process starts, described and at zero, so dashboards and
//! alerts can be built before the first event (Prometheus shows a family only once it has a
//! series). Each process crate keeps its table next to the code that records the values.

/// What kind of series a family has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One metric family: its name, kind and help text.
#[derive(Debug, Clone)]
pub struct Family {
    pub name: String,
    pub kind: Kind,
    pub help: &'static str,
}

impl Family {
    pub fn new(name: impl Into<String>, kind: Kind, help: &'static str) -> Self {
        Self {
            name: name.into(),
            kind,
            help,
        }
    }
}

/// Shorthand for tables of families with static names.
pub fn table(rows: &[(&str, Kind, &'static str)]) -> Vec<Family> {
    rows.iter()
        .map(|(n, k, h)| Family::new(*n, *k, h))
        .collect()
}

/// Describes every family and creates its unlabelled series (adding zero, so a value another
/// server of the same process already recorded stays). Call after the recorder
/// is installed (`telemetry::serve_metrics`), or the registrations go nowhere.
pub fn register(families: &[Family]) {
    for f in families {
        let name = f.name.clone();
        match f.kind {
            Kind::Counter => {
                metrics::describe_counter!(name.clone(), f.help);
                metrics::counter!(name).increment(0);
            }
            Kind::Gauge => {
                metrics::describe_gauge!(name.clone(), f.help);
                metrics::gauge!(name).increment(0.0);
            }
            Kind::Histogram => {
                metrics::describe_histogram!(name.clone(), f.help);
                // Creating the handle registers the family; nothing is observed.
                let _ = metrics::histogram!(name);
            }
        }
    }
}

/// The families every gRPC server exports (`server::GrpcMetricsLayer`).
pub fn grpc_server() -> Vec<Family> {
    table(&[
        (
            "grpc_server_requests_total",
            Kind::Counter,
            "gRPC requests by service, method and status code",
        ),
        (
            "grpc_server_request_duration_seconds",
            Kind::Histogram,
            "gRPC request latency by service and method",
        ),
    ])
}
