//! The model's reply, streamed, split the way OpenAI clients expect it: reasoning (up to
//! `</think>` in thinking mode), content, and tool calls parsed from V4's DSML block
//! (`\n\n<｜DSML｜tool_calls>` … `</｜DSML｜tool_calls>`). Text that might be the start of
//! a marker is held back until the next piece decides it, so markers split across
//! stream chunks are found. Each call is emitted when its `</｜DSML｜invoke>` arrives; a
//! block that does not parse is passed on as content.

use super::encoding::{DSML, EOS, THINK_END};
use super::pyjson::quote;

#[derive(Clone, Debug, PartialEq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    ToolCall { name: String, arguments: String },
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Stage {
    Reasoning,
    Content,
    /// Inside the tool-call block, after its opening line.
    Calls,
    /// After EOS: nothing more is the reply.
    Done,
}

pub struct OutputParser {
    stage: Stage,
    buf: String,
    calls: usize,
    /// The block text consumed so far (returned as content if the block breaks).
    block: String,
}

fn calls_open() -> String {
    format!("\n\n<{DSML}tool_calls>")
}

fn calls_close() -> String {
    format!("</{DSML}tool_calls>")
}

fn invoke_close() -> String {
    format!("</{DSML}invoke>")
}

/// Bytes at the end of `s` that could begin one of `markers` (held back).
fn partial_suffix(s: &str, markers: &[&str]) -> usize {
    let mut keep = 0;
    for m in markers {
        for (i, _) in m.char_indices().skip(1) {
            if i > keep && s.ends_with(&m[..i]) {
                keep = i;
            }
        }
    }
    keep
}

impl OutputParser {
    /// `thinking`: the prompt opened a `<think>` block, so the reply starts as reasoning.
    pub fn new(thinking: bool) -> Self {
        OutputParser {
            stage: if thinking { Stage::Reasoning } else { Stage::Content },
            buf: String::new(),
            calls: 0,
            block: String::new(),
        }
    }

    /// How many tool calls have been parsed.
    pub fn tool_calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            let progressed = match self.stage {
                Stage::Done => {
                    self.buf.clear();
                    false
                }
                Stage::Reasoning => self.text_until(&[THINK_END, EOS], &mut out, Delta::Reasoning),
                Stage::Content => self.text_until(&[&calls_open(), EOS], &mut out, Delta::Content),
                Stage::Calls => self.calls_step(&mut out),
            };
            if !progressed {
                return out;
            }
        }
    }

    /// The rest once the stream has ended.
    pub fn finish(&mut self) -> Vec<Delta> {
        let rest = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        match self.stage {
            Stage::Reasoning if !rest.is_empty() => out.push(Delta::Reasoning(rest)),
            Stage::Content if !rest.is_empty() => out.push(Delta::Content(rest)),
            Stage::Calls => out.push(Delta::Content(std::mem::take(&mut self.block) + &rest)),
            _ => {}
        }
        self.stage = Stage::Done;
        out
    }

    /// Emit text of the current kind up to the first marker (switching stage on it) or
    /// up to a possible partial marker; returns whether the stage changed.
    fn text_until(&mut self, markers: &[&str], out: &mut Vec<Delta>, kind: fn(String) -> Delta) -> bool {
        let found = markers.iter().filter_map(|m| self.buf.find(m).map(|at| (at, *m))).min_by_key(|x| x.0);
        match found {
            Some((at, marker)) => {
                if at > 0 {
                    out.push(kind(self.buf[..at].to_string()));
                }
                self.buf.drain(..at + marker.len());
                self.stage = if marker == EOS {
                    Stage::Done
                } else if marker == THINK_END {
                    Stage::Content
                } else {
                    self.block = marker.to_string();
                    Stage::Calls
                };
                true
            }
            None => {
                let keep = partial_suffix(&self.buf, markers);
                let emit = self.buf.len() - keep;
                if emit > 0 {
                    out.push(kind(self.buf[..emit].to_string()));
                    self.buf.drain(..emit);
                }
                false
            }
        }
    }

    /// Inside the block: parse each complete invoke, then the block's end.
    fn calls_step(&mut self, out: &mut Vec<Delta>) -> bool {
        let trimmed = self.buf.trim_start_matches('\n');
        if trimmed.starts_with(&calls_close()) {
            let end = self.buf.len() - trimmed.len() + calls_close().len();
            self.buf.drain(..end);
            self.block.clear();
            self.stage = Stage::Content;
            return true;
        }
        let Some(at) = self.buf.find(&invoke_close()) else {
            // Give up on a block that cannot be one (EOS inside it, or no invoke opening).
            let may_follow = |tag: &str| {
                if trimmed.len() >= tag.len() { trimmed.starts_with(tag) } else { tag.starts_with(trimmed) }
            };
            let broken =
                self.buf.contains(EOS) || !(may_follow(&format!("<{DSML}invoke")) || may_follow(&calls_close()));
            if broken {
                self.degrade(out);
                return true;
            }
            return false;
        };
        let end = at + invoke_close().len();
        let invoke = self.buf[..end].to_string();
        match parse_invoke(invoke.trim_start_matches('\n')) {
            Some((name, arguments)) => {
                self.calls += 1;
                out.push(Delta::ToolCall { name, arguments });
                self.block.push_str(&invoke);
                self.buf.drain(..end);
                true
            }
            None => {
                self.degrade(out);
                true
            }
        }
    }

    /// A block that does not parse: everything of it so far is content after all.
    fn degrade(&mut self, out: &mut Vec<Delta>) {
        let text = std::mem::take(&mut self.block) + &self.buf;
        self.buf.clear();
        let (content, done) = match text.find(EOS) {
            Some(at) => (text[..at].to_string(), true),
            None => (text, false),
        };
        out.push(Delta::Content(content));
        self.stage = if done { Stage::Done } else { Stage::Content };
    }
}

/// `<｜DSML｜invoke name="N">\n` (`<｜DSML｜parameter name="K" string="B">V</｜DSML｜parameter>\n`)*
/// `</｜DSML｜invoke>` → the name and the arguments as compact JSON.
pub fn parse_invoke(s: &str) -> Option<(String, String)> {
    let rest = s.strip_prefix(&format!("<{DSML}invoke name=\""))?;
    let (name, mut rest) = rest.split_once("\">\n")?;
    if name.is_empty() || name.contains('"') {
        return None;
    }
    let param_open = format!("<{DSML}parameter name=\"");
    let param_close = format!("</{DSML}parameter>");
    let mut members: Vec<String> = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    while let Some(r) = rest.strip_prefix(param_open.as_str()) {
        let (key, r) = r.split_once("\" string=\"")?;
        let (is_string, r) =
            if let Some(r) = r.strip_prefix("true\">") { (true, r) } else { (false, r.strip_prefix("false\">")?) };
        let (value, r) = r.split_once(param_close.as_str())?;
        rest = r.strip_prefix('\n')?;
        if seen.iter().any(|k| k == key) {
            return None;
        }
        seen.push(key.to_string());
        let value = if is_string {
            quote(value)
        } else {
            let v: serde_json::Value = serde_json::from_str(value).ok()?;
            v.to_string()
        };
        members.push(format!("{}:{value}", quote(key)));
    }
    if rest != invoke_close() {
        return None;
    }
    Some((name.to_string(), format!("{{{}}}", members.join(","))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(thinking: bool, text: &str, piece: usize) -> Vec<Delta> {
        let mut p = OutputParser::new(thinking);
        let mut out = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for chunk in chars.chunks(piece) {
            out.extend(p.push(&chunk.iter().collect::<String>()));
        }
        out.extend(p.finish());
        merge(out)
    }

    /// Adjacent text deltas of one kind joined (chunking changes only their number).
    fn merge(deltas: Vec<Delta>) -> Vec<Delta> {
        let mut out: Vec<Delta> = Vec::new();
        for d in deltas {
            match (out.last_mut(), d) {
                (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) => a.push_str(&b),
                (Some(Delta::Content(a)), Delta::Content(b)) => a.push_str(&b),
                (_, d) => out.push(d),
            }
        }
        out
    }

    const CALLS: &str = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris \"centre\"</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">[1, 2]</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_time\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>";

    #[test]
    fn reasoning_content_and_calls_come_apart_at_every_chunking() {
        let text = format!("Let me think</think>Checking.{CALLS}");
        let want = vec![
            Delta::Reasoning("Let me think".into()),
            Delta::Content("Checking.".into()),
            Delta::ToolCall {
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris \"centre\"","days":[1,2]}"#.into(),
            },
            Delta::ToolCall { name: "get_time".into(), arguments: "{}".into() },
        ];
        for piece in [1, 2, 3, 5, 7, 13, 1000] {
            assert_eq!(run(true, &text, piece), want, "chunks of {piece} chars");
        }
    }

    #[test]
    fn plain_answers_stop_at_eos() {
        for piece in [1, 4, 100] {
            assert_eq!(
                run(false, "Hello <b>there</b>\n\nbye<｜end▁of▁sentence｜>junk", piece),
                vec![Delta::Content("Hello <b>there</b>\n\nbye".into())]
            );
            // A partial marker at the end is text after all.
            assert_eq!(run(false, "ends with \n\n<｜DS", piece), vec![Delta::Content("ends with \n\n<｜DS".into())]);
            assert_eq!(run(true, "only thoughts </thi", piece), vec![Delta::Reasoning("only thoughts </thi".into())]);
        }
    }

    #[test]
    fn malformed_calls_degrade_to_content() {
        let cases = [
            "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"x\" string=\"false\">{not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
            "\n\n<｜DSML｜tool_calls>\ngarbage here",
            "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\nno params</｜DSML｜invoke>",
            "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n",
        ];
        for text in cases {
            for piece in [1, 3, 1000] {
                let got = run(false, &format!("a{text}"), piece);
                let content: String = got
                    .iter()
                    .map(|d| match d {
                        Delta::Content(c) => c.clone(),
                        other => panic!("{text:?}: {other:?} from a malformed block"),
                    })
                    .collect();
                assert_eq!(content, format!("a{text}"), "chunks of {piece}");
            }
        }
        // A good call before a broken one is still a call.
        let text = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"g\">\noops</｜DSML｜invoke>";
        let got = run(false, text, 2);
        assert_eq!(got[0], Delta::ToolCall { name: "f".into(), arguments: "{}".into() });
        assert!(matches!(&got[1], Delta::Content(c) if c.ends_with("oops</｜DSML｜invoke>")));
    }

    #[test]
    fn rendered_history_calls_parse_back() {
        use crate::chat::encoding::{PastCall, render_calls};
        let calls =
            vec![PastCall { id: None, name: "f".into(), arguments: r#"{"a": "x", "b": {"c": [1, true]}}"#.into() }];
        let text = render_calls(&calls) + EOS;
        let got = run(false, &text, 3);
        assert_eq!(
            got,
            vec![Delta::ToolCall { name: "f".into(), arguments: r#"{"a":"x","b":{"c":[1,true]}}"#.into() }]
        );
    }
}
