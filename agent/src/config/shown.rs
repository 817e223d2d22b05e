//! Config input as error messages and warnings show it: control characters escaped (an ESC
//! byte in a value never reaches the terminal, a newline never splits the line) and capped (a
//! 200 KB line of a 100k-deep nested array is not echoed whole).

/// The most bytes of quoted input an error shows (a line of the file, a value).
pub const INPUT_MAX: usize = 200;
/// The most bytes of any one part of an error (its message, its key, the path).
pub const PART_MAX: usize = 400;

/// `s` with control characters escaped (`\u{1b}`), cut at about `max` bytes with a note of how
/// much was left out.
pub fn shown(s: &str, max: usize) -> String {
    let mut out = String::with_capacity(s.len().min(max + 32));
    for (i, c) in s.char_indices() {
        if out.len() >= max {
            out.push_str(&format!("… ({} more bytes)", s.len() - i));
            break;
        }
        if c.is_control() {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(shown("te\u{1b}[31mst\n", 100), "te\\u{1b}[31mst\\u{a}");
        assert_eq!(shown("plain é", 100), "plain é");
    }

    #[test]
    fn long_input_is_cut_on_a_character_boundary_saying_how_much() {
        let long = "é".repeat(1000);
        let s = shown(&long, 9);
        assert!(s.starts_with("ééééé…"), "{s}");
        assert!(s.ends_with("(1990 more bytes)"), "{s}");
        assert!(shown(&"[".repeat(100_000), INPUT_MAX).len() < INPUT_MAX + 40);
    }

    #[test]
    fn config_errors_escape_and_cap_what_they_echo() {
        use crate::config::parse;
        // A raw ESC in a string is not TOML: the quoted line shows it escaped.
        let e = parse("[agent]\nlog_format = \"te\u{1b}st\"\n", "f")
            .unwrap_err()
            .to_string();
        assert!(!e.contains('\u{1b}') && e.contains("te\\u{1b}st"), "{e}");
        // An escaped one is TOML: the value is refused and echoed escaped.
        let e = parse("[agent]\nlog_format = \"\\u001b[31mred\"\n", "f")
            .unwrap_err()
            .to_string();
        assert!(!e.contains('\u{1b}') && e.contains("\\u{1b}[31mred"), "{e}");
        let e = parse(
            "[[policy]]\nname = \"p\\u001b]0;x\\u0007\"\nselect = {}\n",
            "f",
        )
        .unwrap_err()
        .to_string();
        assert!(!e.chars().any(char::is_control), "{e}");
        // A 100k-deep nested array: a short error, not the 200 KB line.
        let deep = format!(
            "[agent]\nx = {}{}\n",
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        let e = parse(&deep, "f").unwrap_err().to_string();
        assert!(
            e.len() < 1000,
            "{} bytes: {}",
            e.len(),
            &e[..e.len().min(2000)]
        );
        assert!(e.starts_with("f:2:"), "{e}");
        // A long value in a validation message is capped too.
        let long = format!(
            "[[policy]]\nname = \"{}\"\ntrigger = \"always\"\nselect = {{}}\n",
            "n".repeat(50_000)
        );
        let e = parse(&long, "f").unwrap_err().to_string();
        assert!(
            e.len() < 1000 && e.contains("more bytes)"),
            "{} bytes",
            e.len()
        );
    }
}
