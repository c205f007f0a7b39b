//! The Prometheus text exposition format (version 0.0.4): `# HELP` and
//! `# TYPE` once per family, then one line per sample, label values
//! escaped, histograms as cumulative `_bucket{le=…}` lines plus `_sum`
//! and `_count`.

use std::fmt::Write as _;

use super::HistogramData;

/// The content type of the text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A metric family's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// A label value escaped as the format asks (backslash, quote, newline).
pub fn escape(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// A sample value: integers without a fraction, infinities as `+Inf`.
pub fn value(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_string()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_string()
    } else {
        format!("{v}")
    }
}

/// Builds one exposition.
#[derive(Default)]
pub struct Text {
    out: String,
}

impl Text {
    pub fn new() -> Text {
        Text::default()
    }

    /// Starts a family: its help and type lines.
    pub fn family(&mut self, name: &str, kind: Kind, help: &str) {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {}", kind.name());
    }

    fn labels(&mut self, labels: &[(&str, &str)]) {
        if labels.is_empty() {
            return;
        }
        self.out.push('{');
        for (i, (k, v)) in labels.iter().enumerate() {
            if i > 0 {
                self.out.push(',');
            }
            let _ = write!(self.out, "{k}=\"{}\"", escape(v));
        }
        self.out.push('}');
    }

    /// One sample line.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], v: f64) {
        self.out.push_str(name);
        self.labels(labels);
        let _ = writeln!(self.out, " {}", value(v));
    }

    /// A family with one unlabelled sample.
    pub fn single(&mut self, name: &str, kind: Kind, help: &str, v: f64) {
        self.family(name, kind, help);
        self.sample(name, &[], v);
    }

    /// A whole histogram family: every series of `series`, each labelled
    /// with `label_names` zipped to its values.
    pub fn histogram(
        &mut self,
        name: &str,
        help: &str,
        label_names: &[&str],
        buckets: &[f64],
        series: &[(Vec<String>, HistogramData)],
    ) {
        self.family(name, Kind::Histogram, help);
        let bucket_name = format!("{name}_bucket");
        for (values, data) in series {
            let base: Vec<(&str, &str)> = label_names
                .iter()
                .copied()
                .zip(values.iter().map(String::as_str))
                .collect();
            let cumulative = data.cumulative();
            for (i, b) in buckets.iter().enumerate() {
                let le = value(*b);
                let mut l = base.clone();
                l.push(("le", &le));
                self.sample(
                    &bucket_name,
                    &l,
                    cumulative.get(i).copied().unwrap_or(0) as f64,
                );
            }
            let mut l = base.clone();
            l.push(("le", "+Inf"));
            self.sample(&bucket_name, &l, data.count as f64);
            self.sample(&format!("{name}_sum"), &base, data.sum);
            self.sample(&format!("{name}_count"), &base, data.count as f64);
        }
    }

    pub fn finish(self) -> String {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_label_values() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn values() {
        assert_eq!(value(1.0), "1");
        assert_eq!(value(0.25), "0.25");
        assert_eq!(value(f64::INFINITY), "+Inf");
    }

    #[test]
    fn a_histogram_in_the_text_format() {
        let mut t = Text::new();
        let data = HistogramData {
            per_bucket: vec![1, 0],
            count: 2,
            sum: 3.05,
        };
        t.histogram(
            "h_seconds",
            "H.",
            &["m"],
            &[0.1, 1.0],
            &[(vec!["x".into()], data)],
        );
        assert_eq!(
            t.finish(),
            "# HELP h_seconds H.\n# TYPE h_seconds histogram\n\
             h_seconds_bucket{m=\"x\",le=\"0.1\"} 1\n\
             h_seconds_bucket{m=\"x\",le=\"1\"} 1\n\
             h_seconds_bucket{m=\"x\",le=\"+Inf\"} 2\n\
             h_seconds_sum{m=\"x\"} 3.05\n\
             h_seconds_count{m=\"x\"} 2\n"
        );
    }
}
