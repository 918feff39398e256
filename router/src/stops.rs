//! Stop strings over streamed text: text that could be the start of a stop string is
//! held back until it is clear it is not, so a client never sees part of a stop string.

/// Where a stream of text deltas stands against a set of stop strings.
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet released.
    pending: String,
}

/// What to do with a delta.
#[derive(Debug, PartialEq, Eq)]
pub enum Release {
    /// Emit this text and go on.
    Text(String),
    /// Emit this text (what came before the stop string) and finish.
    Stop(String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops, pending: String::new() }
    }

    pub fn push(&mut self, delta: &str) -> Release {
        if self.stops.is_empty() {
            return Release::Text(delta.to_string());
        }
        self.pending.push_str(delta);
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            let before = self.pending[..at].to_string();
            self.pending.clear();
            return Release::Stop(before);
        }
        // Keep the longest tail that is a prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).filter(move |&n| s.is_char_boundary(n)).map(move |n| &s[..n]))
            .filter(|p| self.pending.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        Release::Text(out)
    }

    /// The stream ended without a stop string: release what was held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_partial_stops_and_cuts_at_the_stop() {
        let mut m = StopMatcher::new(vec!["###".into(), "END".into()]);
        assert_eq!(m.push("hello #"), Release::Text("hello ".into()));
        assert_eq!(m.push("#"), Release::Text(String::new()));
        assert_eq!(m.push("x"), Release::Text("##x".into()), "not a stop after all");
        assert_eq!(m.push(" the E"), Release::Text(" the ".into()));
        assert_eq!(m.push("ND and more"), Release::Stop(String::new()));

        let mut m = StopMatcher::new(vec!["stop".into()]);
        assert_eq!(m.push("a sto"), Release::Text("a ".into()));
        assert_eq!(m.finish(), "sto");
        let mut none = StopMatcher::new(vec![]);
        assert_eq!(none.push("x###"), Release::Text("x###".into()));
    }
}
