//! `claimd metrics` and `claimd health`: commands without a verb, for
//! monitoring and probes.

use super::*;

/// A client command without a verb.
pub struct Single {
    pub name: &'static str,
    pub about: &'static str,
    pub details: &'static str,
    run: fn(&Call) -> Result<(), CliError>,
}

pub const METRICS: Single = Single {
    name: "metrics",
    about: "print the agent's metrics in the Prometheus text format",
    details: "\
Prints every metric of the agent in the Prometheus text format (what
GET /metrics serves when `metrics_listen` is set), over the API socket: no
network listener is needed. --json wraps the text: {\"text\": \"...\"}.
",
    run: metrics,
};

pub const HEALTH: Single = Single {
    name: "health",
    about: "say whether the agent is ready, degraded or unreachable",
    details: "\
Asks the agent for its health; usable as a probe by scripts. The agent
answers only once its restore is done, so an answer means ready. Problems
that make it degraded, one line each on standard output:
    - a plugin is unhealthy (its probe fails or its socket is gone);
    - a volume's release has failed 3 times or more and is still
      retrying, or gave up;
    - a volume's plugin reports it abnormal (VOLUME_CONDITION).

EXIT CODES:
    0  ready: prints \"ready\"
    1  degraded: one line per problem
    3  the agent is not reachable

OUTPUT:
    with --json {\"ready\", \"degraded\", \"problems\": [LINES]}
",
    run: health,
};

/// Every verbless client command, in help order.
pub const SINGLES: [&Single; 2] = [&METRICS, &HEALTH];

impl Single {
    pub fn help(&self) -> String {
        format!(
            "claimd {name}: {about}.

USAGE:
    claimd {name} [--socket PATH] [--json]

{details}
{options}",
            name = self.name,
            about = self.about,
            details = self.details,
            options = client_options(),
        )
    }

    /// Runs `claimd NAME ARGS...`.
    pub fn run(&self, args: &[String]) -> Result<(), CliError> {
        let help = format!("claimd {}", self.name);
        let (client, rest) = parse_common(args).map_err(|e| CliError::usage(e, help.clone()))?;
        if rest.iter().any(|a| a == "-h" || a == "--help") {
            print!("{}", self.help());
            return Ok(());
        }
        let call = Call {
            client,
            args: rest,
            help,
        };
        call.positional(0)?;
        (self.run)(&call)
    }
}

fn metrics(c: &Call) -> Result<(), CliError> {
    let api = c.connect()?;
    let r = api.call("metrics", QUICK_CALL_TIMEOUT, |a, o| {
        a.get_metrics(&w::GetMetricsRequest::new(), o)
    })?;
    if c.json() {
        println!("{}", json!({ "text": r.text }));
    } else {
        print!("{}", r.text);
    }
    Ok(())
}

fn health(c: &Call) -> Result<(), CliError> {
    let api = c.connect()?;
    let r = api.call("health", QUICK_CALL_TIMEOUT, |a, o| {
        a.get_health(&w::GetHealthRequest::new(), o)
    })?;
    let degraded = !r.problems.is_empty();
    if c.json() {
        println!(
            "{}",
            json!({"ready": r.ready, "degraded": degraded, "problems": r.problems})
        );
    } else if degraded {
        for p in &r.problems {
            println!("{p}");
        }
    } else {
        println!("ready");
    }
    if degraded {
        return Err(CliError::Degraded {
            problems: r.problems.len(),
        });
    }
    Ok(())
}
